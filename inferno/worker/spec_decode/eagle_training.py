"""An EAGLE head distilled from the target (the EAGLE paper's recipe): teacher forcing on the target's own features
over sequences it generated. At each position p the head reads the embedding of the token at p + 1 and the target's
feature (final hidden state after the final norm) at p; its output is trained to be the target's feature at p + 1
(smooth L1) and, through the target's frozen LM head, to predict the token at p + 2 (cross entropy, weighted 0.1 as
in the paper). The target is frozen; the head is trained with AdamW, in float32 on the CPU, on the continuations'
positions (the prompt is the head's context only)."""
import random

import torch
import torch.nn.functional as F
from tqdm import tqdm

from inferno.core.head_training import HeadTrainingConfig, TrainingSequence
from inferno.layers.rotary import interleave_rotary_rows
from inferno.loader.eagle_folder import EagleFolder, eagle_config_json, head_layer_config
from inferno.model.eagle import EagleHead
from inferno.worker.model_runner import ModelRunner
from inferno.worker.spec_decode.head_training import dense_lm_head, record_hidden_states, usable_sequences

CLASSIFICATION_WEIGHT = 0.1  # the paper's w_cls


def sequence_example(runner: ModelRunner, features: torch.Tensor, sequence: TrainingSequence
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For positions p = 0..n-2: the embeddings of the tokens at p + 1, the features at p, the labels (the token at
    p + 2; -100 past the end and before the continuation) and the target features at p + 1."""
    ids = torch.tensor(sequence.token_ids)
    with torch.inference_mode():
        embeds = runner.model.embed_tokens(ids[1:].to(runner.device)).float().cpu()
    labels = torch.full((len(ids) - 1,), -100)
    first = max(sequence.num_prompt_tokens - 2, 0)
    labels[first:-1] = ids[first + 2:]
    return embeds.clone(), features[:-1].clone(), labels, features[1:].clone()


def train_eagle_head(runner: ModelRunner, sequences: list[TrainingSequence], config: HeadTrainingConfig,
                     base_model: str | None = None) -> tuple[EagleFolder, list[float]]:
    """The trained head (using the target's embedding and LM head), and its top-1 accuracy on held-out positions."""
    usable = usable_sequences(runner, sequences, "an EAGLE head")
    features = [f.cpu() for f in record_hidden_states(runner, usable)]
    examples = [sequence_example(runner, f, s) for f, s in zip(features, usable)]
    random.Random(config.seed).shuffle(examples)
    num_held_out = max(1, round(config.held_out_fraction * len(examples)))
    train, test = examples[num_held_out:], examples[:num_held_out]
    torch.manual_seed(config.seed)
    layer_config = head_layer_config(runner.config)
    head = EagleHead(layer_config, fc_bias=True, own_lm_head=False).float()
    lm_head = torch.nn.Linear(layer_config.hidden_size, layer_config.vocab_size, bias=False)
    lm_head.weight = torch.nn.Parameter(dense_lm_head(runner).cpu(), requires_grad=False)
    fit(head, lm_head, train, test, config)
    tensors = hf_tensors(head)
    accuracy = held_out_accuracy(head, lm_head, test)
    return EagleFolder(eagle_config_json(layer_config, True, base_model), tensors), [accuracy]


def batches(examples: list, size: int, generator: torch.Generator | None = None):
    """Examples padded into [B, T, ...] batches (causal attention: padding after a sequence never reaches it)."""
    order = torch.randperm(len(examples), generator=generator).tolist() if generator else range(len(examples))
    order = list(order)
    for start in range(0, len(order), size):
        group = [examples[i] for i in order[start:start + size]]
        yield tuple(torch.nn.utils.rnn.pad_sequence([g[j] for g in group], batch_first=True,
                                                    padding_value=-100 if j == 2 else 0.0) for j in range(4))


def loss_of(head: EagleHead, lm_head: torch.nn.Module, batch) -> torch.Tensor:
    embeds, features, labels, next_features = batch
    out = head.forward_dense(embeds, features)
    kept = labels != -100
    regression = F.smooth_l1_loss(out[kept], next_features[kept])
    classification = F.cross_entropy(lm_head(out[kept]), labels[kept])
    return regression + CLASSIFICATION_WEIGHT * classification


def fit(head: EagleHead, lm_head: torch.nn.Module, train: list, test: list, config: HeadTrainingConfig) -> None:
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate)
    longest = max(len(e[2]) for e in train)
    per_step = max(1, config.batch_size // longest)  # batch_size counts positions
    steps_per_epoch = -(-len(train) // per_step)
    generator = torch.Generator().manual_seed(config.seed)
    with tqdm(total=config.epochs * steps_per_epoch, desc="training an EAGLE head", dynamic_ncols=True) as bar:
        for _ in range(config.epochs):
            for batch in batches(train, per_step, generator):
                loss = loss_of(head, lm_head, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.set_postfix(loss=f"{loss.item():.3f}", held_out_top1=f"{held_out_accuracy(head, lm_head, test):.2f}")


@torch.no_grad()
def held_out_accuracy(head: EagleHead, lm_head: torch.nn.Module, test: list) -> float:
    """The fraction of held-out continuation positions where the head's top-1 is the target's next-but-one token
    (teacher-forced: the first draft's accuracy)."""
    correct = total = 0
    for embeds, features, labels, _ in batches(test, 8):
        kept = labels != -100
        top1 = lm_head(head.forward_dense(embeds, features)[kept]).argmax(-1)
        correct += int((top1 == labels[kept]).sum())
        total += int(kept.sum())
    return correct / max(total, 1)


def hf_tensors(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's weights under the HF names of the folder (q/k/v and gate/up apart, rotate-half row order)."""
    config = head.config
    tensors = {}
    for name, value in head.state_dict().items():
        value = value.detach().float().clone()
        if ".qkv_proj." in name:
            sizes = [config.num_attention_heads * config.head_dim] + [config.num_key_value_heads * config.head_dim] * 2
            for proj, part, heads in zip("qkv", value.split(sizes),
                                         (config.num_attention_heads, config.num_key_value_heads, None)):
                part = part if heads is None else _rotate_half_rows(part, heads)
                tensors[name.replace("qkv_proj", f"{proj}_proj")] = part
        elif ".gate_up_proj." in name:
            gate, up = value.chunk(2)
            tensors[name.replace("gate_up_proj", "gate_proj")] = gate
            tensors[name.replace("gate_up_proj", "up_proj")] = up
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            tensors[name] = _rotate_half_rows(value, 1)
        else:
            tensors[name] = value
    return tensors


def _rotate_half_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of `interleave_rotary_rows`."""
    out = w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    assert torch.equal(interleave_rotary_rows(out, num_heads), w)
    return out
