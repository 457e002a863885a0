"""Medusa heads distilled from the target: its final hidden states over sequences it generated itself (after the
final norm, as the proposer reads them), and the tokens it went on to generate as the labels. The target is
frozen: each head's residual blocks are trained with AdamW, in float32 on the CPU, through the target's own LM
head (so the heads start as the LM head itself: the blocks start at zero, as Medusa's do)."""
import random

import torch
from tqdm import tqdm

from inferno.core.head_training import HeadTrainingConfig, TrainingSequence
from inferno.core.kv_blocks import cdiv
from inferno.loader.medusa_folder import MedusaFolder
from inferno.model.medusa import MedusaHeads
from inferno.worker.calibration import prefill_step
from inferno.worker.model_runner import ModelRunner

IGNORE = -100  # label of a head past the sequence's end
PREFILL_BATCH_TOKENS = 2048  # tokens per recording pass (several sequences batched as one step's prefills)
# the recorded features' dtype on the CPU: half of float32's memory (a million positions of a 1536-wide model:
# 3 GB), 11 significant bits; the training reads them as float32
FEATURE_DTYPE = torch.float16


@torch.inference_mode()
def usable_sequences(runner: ModelRunner, sequences: list[TrainingSequence], what: str) -> list[TrainingSequence]:
    """The sequences with 2 or more generated tokens (a head learns from the tokens after the next); ValueError where
    fewer than 2 are, or the runner is one of several processes."""
    if runner.parallel.world_size > 1:
        raise ValueError("training draft heads runs on one process")
    usable = [s for s in sequences if len(s.token_ids) - s.num_prompt_tokens >= 2]
    if len(usable) < 2:
        raise ValueError(f"training {what} needs at least 2 sequences with 2 or more generated tokens, got "
                         f"{len(usable)}")
    return usable


@torch.no_grad()
def record_hidden_states(runner: ModelRunner, sequences: list[TrainingSequence]) -> list[torch.Tensor]:
    """Per sequence, the hidden states [n, hidden] after the final norm, on the CPU in FEATURE_DTYPE (float32 for a
    pass whose states do not fit it), recorded in batched prefill passes; with no request holding blocks."""
    longest = max(len(s.token_ids) for s in sequences)
    if cdiv(longest, runner.block_size) > runner.num_blocks:
        raise ValueError(f"a training sequence of {longest} tokens does not fit the KV cache's {runner.num_blocks} "
                         f"blocks of {runner.block_size}")
    hidden = []
    for batch in prefill_batches([s.token_ids for s in sequences], runner.block_size, runner.num_blocks):
        out = runner.model.norm(runner.forward(prefill_step(batch, runner.block_size).micro_batches[0])).cpu()
        kept = out.to(FEATURE_DTYPE)
        hidden += (kept if bool(torch.isfinite(kept).all()) else out.float()).split([len(ids) for ids in batch])
    return hidden


def prefill_batches(sequences: list[list[int]], block_size: int, num_blocks: int,
                    max_tokens: int = PREFILL_BATCH_TOKENS) -> list[list[list[int]]]:
    """The sequences in order, grouped into prefill batches of up to `max_tokens` tokens (a longer sequence alone)
    whose blocks fit the KV cache."""
    batches, tokens, blocks = [], 0, 0
    for ids in sequences:
        if batches and tokens + len(ids) <= max_tokens and blocks + cdiv(len(ids), block_size) <= num_blocks:
            batches[-1].append(ids)
        else:
            batches.append([ids])
            tokens = blocks = 0
        tokens, blocks = tokens + len(ids), blocks + cdiv(len(ids), block_size)
    return batches


def head_examples(hidden: torch.Tensor, sequence: TrainingSequence, num_heads: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [m, hidden] (the continuation's positions p, from the prompt's last token) and labels [m, heads]:
    head j's label at p is the token at p + 2 + j (IGNORE past the end)."""
    ids = torch.tensor(sequence.token_ids)
    n, first = len(ids), sequence.num_prompt_tokens - 1
    positions = torch.arange(first, n - 2)
    targets = positions.unsqueeze(1) + 2 + torch.arange(num_heads)
    labels = torch.where(targets < n, ids[targets.clamp(max=n - 1)], IGNORE)
    return hidden[positions], labels


def dense_weight(runner: ModelRunner, linear: torch.nn.Module, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer of the target as a float32 weight [out, in] and bias [out] (zeros where it has none), on the
    CPU, whatever its weights' format (quantized ones included): its outputs for the unit vectors and for zero."""
    with torch.inference_mode():
        inputs = torch.cat([torch.eye(in_features), torch.zeros(1, in_features)])
        out = linear(inputs.to(runner.dtype).to(runner.device)).float().cpu()
    bias = out[-1]
    # normal tensors: inference-mode ones cannot take part in autograd
    return (out[:-1] - bias).t().clone(), bias.clone()


def dense_lm_head(runner: ModelRunner) -> torch.Tensor:
    """The target's LM head as a float32 matrix [vocab, hidden]."""
    return dense_weight(runner, runner.model.lm_head, runner.config.hidden_size)[0]


def train_medusa_heads(runner: ModelRunner, sequences: list[TrainingSequence], config: HeadTrainingConfig,
                       base_model: str | None = None) -> tuple[MedusaFolder, list[float]]:
    """The trained heads (using the target's LM head), and each head's top-1 accuracy on the held-out sequences."""
    usable = usable_sequences(runner, sequences, "draft heads")
    hidden = record_hidden_states(runner, usable)
    examples = [head_examples(h, s, config.num_heads) for h, s in zip(hidden, usable)]
    random.Random(config.seed).shuffle(examples)
    num_held_out = max(1, round(config.held_out_fraction * len(examples)))
    train_x, train_y = (torch.cat(t) for t in zip(*examples[num_held_out:]))
    test_x, test_y = (torch.cat(t) for t in zip(*examples[:num_held_out]))
    torch.manual_seed(config.seed)
    heads = MedusaHeads(config.num_heads, config.num_layers, runner.config.hidden_size, runner.config.vocab_size,
                        own_lm_heads=False)
    for block in heads.blocks:  # each head starts as the target's LM head
        for layer in block:
            torch.nn.init.zeros_(layer.linear.weight)
            torch.nn.init.zeros_(layer.linear.bias)
    lm_head = torch.nn.Linear(runner.config.hidden_size, runner.config.vocab_size, bias=False)
    lm_head.weight = torch.nn.Parameter(dense_lm_head(runner).cpu(), requires_grad=False)
    fit(heads, lm_head, (train_x, train_y), (test_x, test_y), config)
    accuracy = held_out_accuracy(heads, lm_head, test_x, test_y, config.batch_size)
    return as_folder(heads, base_model), accuracy


def fit(heads: MedusaHeads, lm_head: torch.nn.Module, train: tuple[torch.Tensor, torch.Tensor],
        test: tuple[torch.Tensor, torch.Tensor], config: HeadTrainingConfig) -> None:
    x, y = train
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.learning_rate)
    steps_per_epoch = cdiv(len(x), config.batch_size)
    generator = torch.Generator().manual_seed(config.seed)
    with tqdm(total=config.epochs * steps_per_epoch, desc="training Medusa heads", dynamic_ncols=True) as bar:
        for _ in range(config.epochs):
            order = torch.randperm(len(x), generator=generator)
            for start in range(0, len(x), config.batch_size):
                batch = order[start:start + config.batch_size]
                logits = heads.logits(x[batch].float(), lm_head)  # [heads, b, vocab]
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[batch].t().flatten(),
                                                         ignore_index=IGNORE)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
            accuracy = held_out_accuracy(heads, lm_head, *test, config.batch_size)
            bar.set_postfix(loss=f"{loss.item():.3f}", held_out_top1=" ".join(f"{a:.2f}" for a in accuracy))


@torch.no_grad()
def held_out_accuracy(heads: MedusaHeads, lm_head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                      batch_size: int) -> list[float]:
    """Per head, the fraction of its labelled positions where its top-1 is the label."""
    correct = torch.zeros(heads.num_heads)
    for start in range(0, len(x), batch_size):
        top1 = heads.logits(x[start:start + batch_size].float(), lm_head).argmax(-1).t()  # [b, heads]
        correct += (top1 == y[start:start + batch_size]).sum(0)
    return (correct / (y != IGNORE).sum(0).clamp(min=1)).tolist()


def as_folder(heads: MedusaHeads, base_model: str | None) -> MedusaFolder:
    blocks = [[(layer.linear.weight.detach().clone(), layer.linear.bias.detach().clone()) for layer in block]
              for block in heads.blocks]
    return MedusaFolder(heads.num_heads, heads.num_layers, blocks, None, base_model)
