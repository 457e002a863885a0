"""An EAGLE head distilled from the target (the EAGLE paper's recipe): teacher forcing on the target's own features
over sequences it generated. At each position p the head reads the embedding of the token at p + 1 and the target's
feature (final hidden state after the final norm) at p; its output is trained to be the target's feature at p + 1
(smooth L1) and, through the target's frozen LM head, to predict the target's distribution of the token at p + 2
(soft labels: its softmax at p + 1; cross entropy, weighted 0.1 as in the paper). The target is frozen; the head is
trained with AdamW (warm-up, then cosine decay), in float32 on the CPU, on the continuations' positions (the prompt
is the head's context only), on inputs and targets divided by their RMS, the scales folded into its weights at the
end."""
import math
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

# the recipe: the loss and its inputs
REGRESSION_WEIGHT = 1.0  # the paper's w_reg
CLASSIFICATION_WEIGHT = 0.1  # the paper's w_cls
NORMALISED = True  # train on embeddings and features divided by their RMS (`normalised`), then fold the scales in
SOFT_LABELS = True  # cross entropy against the target's own distribution at p + 1 (else its token at p + 2)
BF16_LM_HEAD = True  # the frozen LM head's matmuls in bfloat16 (most of the cost; the head itself stays float32)
WARMUP_FRACTION = 0.05  # of the steps: the learning rate rises linearly, then follows a cosine down to 0


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


def eagle_examples(runner: ModelRunner, sequences: list[TrainingSequence], config: HeadTrainingConfig
                   ) -> tuple[list, list]:
    """The training and the held-out examples (`sequence_example`)."""
    usable = usable_sequences(runner, sequences, "an EAGLE head")
    features = [f.cpu() for f in record_hidden_states(runner, usable)]
    pairs = list(zip(features, usable))
    random.Random(config.seed).shuffle(pairs)
    num_held_out = max(1, round(config.held_out_fraction * len(pairs)))
    examples = [sequence_example(runner, f, s) for f, s in pairs]
    train, test = examples[num_held_out:], examples[:num_held_out]
    return train, test


def train_eagle_head(runner: ModelRunner, sequences: list[TrainingSequence], config: HeadTrainingConfig,
                     base_model: str | None = None) -> tuple[EagleFolder, list[float]]:
    """The trained head (using the target's embedding and LM head), and its top-1 accuracy on held-out positions."""
    train, test = eagle_examples(runner, sequences, config)
    layer_config = head_layer_config(runner.config)
    head, lm_head = new_head(layer_config, dense_lm_head(runner).cpu(), config.seed)
    fit(head, lm_head, train, test, config)
    accuracy = held_out_accuracy(head, lm_head, test)
    return EagleFolder(eagle_config_json(layer_config, True, base_model), hf_tensors(head)), [accuracy]


def new_head(layer_config, lm_head_weight: torch.Tensor, seed: int) -> tuple[EagleHead, torch.nn.Module]:
    """A fresh float32 head, and the target's frozen LM head."""
    torch.manual_seed(seed)
    head = EagleHead(layer_config, fc_bias=True, own_lm_head=False).float()
    lm_head = torch.nn.Linear(layer_config.hidden_size, layer_config.vocab_size, bias=False)
    weight = lm_head_weight.bfloat16() if BF16_LM_HEAD else lm_head_weight
    lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)
    return head, lm_head


def batches(examples: list, size: int, generator: torch.Generator | None = None):
    """Examples padded into [B, T, ...] batches (causal attention: padding after a sequence never reaches it)."""
    order = torch.randperm(len(examples), generator=generator).tolist() if generator else range(len(examples))
    order = list(order)
    for start in range(0, len(order), size):
        group = [examples[i] for i in order[start:start + size]]
        yield tuple(torch.nn.utils.rnn.pad_sequence([g[j] for g in group], batch_first=True,
                                                    padding_value=-100 if j == 2 else 0.0) for j in range(4))


def rms(tensors: list[torch.Tensor]) -> float:
    return (sum(float(t.double().square().sum()) for t in tensors) / sum(t.numel() for t in tensors)) ** 0.5


def normalised(examples: list, embed_scale: float, feature_scale: float) -> list:
    """The examples with embeddings and features divided by their RMS: the head trains on unit-scale inputs (raw,
    Qwen's post-norm features are ~400 times the embeddings, which the head then cannot see)."""
    return [(e / embed_scale, f / feature_scale, labels, n / feature_scale) for e, f, labels, n in examples]


@torch.no_grad()
def fold_scales(head: EagleHead, embed_scale: float, feature_scale: float) -> None:
    """Turns a head trained on `normalised` examples into one for the raw embeddings and features, exactly: the fc
    reads its inputs divided by their scales, and every layer weight that writes the residual stream is multiplied
    by the feature scale (the q/k/v projections divided by it: they read that stream; the MLP reads it through a
    norm), so the output comes out in the target's feature units."""
    hidden = head.config.hidden_size
    attn, mlp = head.layers[0].self_attn, head.layers[0].mlp
    head.fc.weight[:, :hidden] /= embed_scale
    head.fc.weight[:, hidden:] /= feature_scale
    for param in (head.fc.weight, head.fc.bias, attn.o_proj.weight, mlp.down_proj.weight):
        if param is not None:
            param *= feature_scale
    attn.qkv_proj.weight /= feature_scale


def logits_of(lm_head: torch.nn.Module, features: torch.Tensor) -> torch.Tensor:
    return lm_head(features.to(lm_head.weight.dtype)).float()


def loss_of(head: EagleHead, lm_head: torch.nn.Module, batch) -> torch.Tensor:
    embeds, features, labels, next_features = batch
    kept = labels != -100
    out, target = head.forward_dense(embeds, features)[kept], next_features[kept]
    regression = F.smooth_l1_loss(out, target)
    if SOFT_LABELS:
        with torch.no_grad():
            labels = logits_of(lm_head, target).softmax(-1)
    else:
        labels = labels[kept]
    return REGRESSION_WEIGHT * regression + CLASSIFICATION_WEIGHT * F.cross_entropy(logits_of(lm_head, out), labels)


def warmup_cosine(total_steps: int):
    """The learning rate's factor at each step: a linear warm-up, then a cosine down to 0."""
    warmup = max(1, round(WARMUP_FRACTION * total_steps))
    return lambda step: (step + 1) / warmup if step < warmup else \
        0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))


def fit(head: EagleHead, lm_head: torch.nn.Module, train: list, test: list, config: HeadTrainingConfig) -> None:
    """Trains `head` on normalised examples (NORMALISED: the features and embeddings divided by their RMS), then
    folds the scales into its weights: it reads and writes the target's raw features."""
    embed_scale, feature_scale = (rms([e[0] for e in train]), rms([e[1] for e in train])) if NORMALISED else (1, 1)
    train, test = normalised(train, embed_scale, feature_scale), normalised(test, embed_scale, feature_scale)
    scaled_lm_head = torch.nn.Linear(lm_head.in_features, lm_head.out_features, bias=False)  # reads normalised ones
    scaled_lm_head.weight = torch.nn.Parameter(lm_head.weight * feature_scale, requires_grad=False)
    train_on(head, scaled_lm_head, train, test, config)
    fold_scales(head, embed_scale, feature_scale)


def train_on(head: EagleHead, lm_head: torch.nn.Module, train: list, test: list, config: HeadTrainingConfig) -> None:
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate)
    longest = max(len(e[2]) for e in train)
    per_step = max(1, config.batch_size // longest)  # batch_size counts positions
    steps_per_epoch = -(-len(train) // per_step)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.epochs * steps_per_epoch))
    generator = torch.Generator().manual_seed(config.seed)
    with tqdm(total=config.epochs * steps_per_epoch, desc="training an EAGLE head", dynamic_ncols=True) as bar:
        for _ in range(config.epochs):
            for batch in batches(train, per_step, generator):
                loss = loss_of(head, lm_head, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
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
        top1 = logits_of(lm_head, head.forward_dense(embeds, features)[kept]).argmax(-1)
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
