"""An EAGLE head distilled from the target (the EAGLE paper's recipe, with EAGLE-3's reduced draft vocabulary):
teacher forcing on the target's own features over whole sequences (prompts, the target's continuations, plain text:
a prefill of each gives the features and labels at every position, no generation needed). At each position p the
head reads the embedding of the token at p + 1 and the target's feature (final hidden state after the final norm)
at p; its output is trained to be the target's feature at p + 1 (smooth L1) and, through the head's LM head, to
predict the target's distribution of the token at p + 2 (soft labels: the target's softmax at p + 1 over the draft
vocabulary, renormalised on it; cross entropy, weighted 0.1 as in the paper).

Teacher forcing alone leaves a head poor at continuing from its own output, which its drafts 2..k read instead of
the target's features. So training unrolls `unroll_steps` draft steps (EAGLE-3's "training-time test",
`EagleHead.forward_steps`): step j > 1 reads the head's own step j - 1 output one position back, attending to its
earlier steps' keys as the proposer's passes do on the head's KV cache, with the same loss against the target at
every step (step j's weighted STEP_DECAY^(j - 1), as EAGLE-3 does). The held-out top-1 is reported per draft depth:
depth j is step j's (the real tokens read, the head's own features).

The draft vocabulary is the `draft_vocab_size` most frequent tokens of the training sequences (EAGLE-3): the head's
own LM head is those rows of the target's, frozen, and its drafts map back through `d2t` (most of a draft's cost on
a CPU is the LM head: a Qwen2.5 vocabulary is 151,936 rows). Its decoder layer starts as a copy of the target's
last one (`INIT_FROM_TARGET`; the fc passes the feature through), or at random. The target is frozen; the head is
trained with AdamW (warm-up, then cosine decay), in float32 on the CPU, on inputs and targets divided by their RMS,
the scales folded into its weights at the end.

The data stays as compact as it was recorded: per sequence its tokens and the target's features in float16
(`head_training.FEATURE_DTYPE`), one copy, from which each batch is made (the embeddings looked up, the features at p
and p + 1 as float32, divided by their scales): 3 KB a position on a 1536-wide model, where the float32 inputs,
targets and normalised copies of them all kept took 37."""
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from inferno.core.head_training import HeadTrainingConfig, TrainingSequence
from inferno.layers.rotary import interleave_rotary_rows
from inferno.loader.eagle_folder import EagleFolder, eagle_config_json, head_layer_config
from inferno.model.eagle import EagleHead
from inferno.worker.model_runner import ModelRunner
from inferno.worker.spec_decode.head_training import dense_lm_head, dense_weight, record_hidden_states, \
    usable_sequences

# the recipe: the loss and its inputs
REGRESSION_WEIGHT = 1.0  # the paper's w_reg
CLASSIFICATION_WEIGHT = 0.1  # the paper's w_cls
NORMALISED = True  # train on embeddings and features divided by their RMS (`normalised`), then fold the scales in
BF16_LM_HEAD = True  # the frozen LM heads' matmuls in bfloat16 (most of the cost; the head itself stays float32)
WARMUP_FRACTION = 0.05  # of the steps: the learning rate rises linearly, then follows a cosine down to 0
INIT_FROM_TARGET = True  # the head's layer starts as the target's last decoder layer (else at random)
STEP_DECAY = 0.8  # the loss of unrolled draft step j is weighted STEP_DECAY ** (j - 1) (EAGLE-3's)
EVAL_DEPTHS = 3  # the held-out top-1 is reported for draft depths 1..EVAL_DEPTHS

PADDING, PROMPT, CONTINUATION = 0, 1, 2  # the kinds of positions: every one but padding is trained on; the held-out
# accuracy is measured on the continuations' (what a head drafts; a text is all continuation)


@dataclass(frozen=True, slots=True)
class Example:
    """One sequence: at every position p = 0..n-2 the head reads the embedding of the token at p + 1 and the feature
    at p, and learns the feature at p + 1 (the target's distribution of the token at p + 2 is the label)."""
    ids: torch.Tensor  # [n] the tokens
    features: torch.Tensor  # [n, hidden] the target's (FEATURE_DTYPE)
    kinds: torch.Tensor  # [n - 1] int8: PROMPT, or CONTINUATION from the prompt's last token but one on

    @classmethod
    def of(cls, features: torch.Tensor, sequence: TrainingSequence) -> "Example":
        kinds = torch.full((len(sequence.token_ids) - 1,), PROMPT, dtype=torch.int8)
        kinds[max(sequence.num_prompt_tokens - 2, 0):] = CONTINUATION
        return cls(torch.tensor(sequence.token_ids), features, kinds)


class TrainingData:
    """Examples as padded float32 batches [B, T, ...]: the embeddings (`embed`: token ids -> float32 [n, hidden])
    and the features divided by `embed_scale` and `feature_scale`, made as they are read."""

    def __init__(self, examples: list[Example], embed: Callable[[torch.Tensor], torch.Tensor],
                 embed_scale: float = 1.0, feature_scale: float = 1.0):
        self.examples, self.embed = examples, embed
        self.embed_scale, self.feature_scale = embed_scale, feature_scale

    def __len__(self) -> int:
        return len(self.examples)

    def longest(self) -> int:
        return max(len(e.kinds) for e in self.examples)

    def batches(self, size: int, generator: torch.Generator | None = None, count: int | None = None
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(embeddings, features at p, kinds, features at p + 1) of `size` examples at a time (in a random order with
        `generator`; the first `count` examples only), padded after each sequence (PADDING: causal attention never
        reaches it)."""
        order = torch.randperm(len(self), generator=generator).tolist() if generator else range(len(self))
        order = list(order)[:count]
        for start in range(0, len(order), size):
            group = [self.examples[i] for i in order[start:start + size]]
            parts = [(self.embed(e.ids[1:]) / self.embed_scale, e.features[:-1].float() / self.feature_scale,
                      e.kinds, e.features[1:].float() / self.feature_scale) for e in group]
            yield tuple(torch.nn.utils.rnn.pad_sequence([p[j] for p in parts], batch_first=True) for j in range(4))

    def scaled(self, embed_scale: float, feature_scale: float) -> "TrainingData":
        return TrainingData(self.examples, self.embed, embed_scale, feature_scale)


def embedder(runner: ModelRunner) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's embedding of token ids, float32 on the CPU (normal tensors: inference-mode ones cannot take part
    in autograd)."""
    def embed(ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = runner.model.embed_tokens(ids.to(runner.device)).float().cpu()
        return out.clone()
    return embed


def eagle_examples(runner: ModelRunner, sequences: list[TrainingSequence], config: HeadTrainingConfig
                   ) -> tuple[TrainingData, TrainingData, list[TrainingSequence]]:
    """The training and the held-out examples, and the training sequences."""
    usable = usable_sequences(runner, sequences, "an EAGLE head")
    examples = [Example.of(f, s) for f, s in zip(record_hidden_states(runner, usable), usable)]
    pairs = list(zip(examples, usable))
    random.Random(config.seed).shuffle(pairs)
    num_held_out = max(1, round(config.held_out_fraction * len(pairs)))
    embed = embedder(runner)
    return (TrainingData([e for e, _ in pairs[num_held_out:]], embed),
            TrainingData([e for e, _ in pairs[:num_held_out]], embed), [s for _, s in pairs[num_held_out:]])


def draft_vocabulary(sequences: list[TrainingSequence], vocab_size: int, size: int | None) -> torch.Tensor | None:
    """The target ids of the draft vocabulary, ascending: the `size` most frequent tokens of the training sequences
    (then the lowest ids never seen, where fewer were); None for the whole vocabulary."""
    if not size or size >= vocab_size:
        return None
    counts = Counter(t for s in sequences for t in s.token_ids)
    kept = {t for t, _ in counts.most_common(size)}
    kept |= set([t for t in range(vocab_size) if t not in kept][:size - len(kept)])
    return torch.tensor(sorted(kept))


def train_eagle_head(runner: ModelRunner, sequences: list[TrainingSequence], config: HeadTrainingConfig,
                     base_model: str | None = None) -> tuple[EagleFolder, list[float]]:
    """The trained head (the target's embedding; its LM head, or the draft vocabulary's rows of it), and its top-1
    agreement with the target's greedy token on held-out positions per draft depth 1..EVAL_DEPTHS (also in the
    folder's config.json, `inferno_training`)."""
    train, test, train_sequences = eagle_examples(runner, sequences, config)
    layer_config = head_layer_config(runner.config)
    lm_head = frozen_linear(dense_lm_head(runner).cpu())
    vocabulary = draft_vocabulary(train_sequences, runner.config.vocab_size, config.draft_vocab_size)
    head = new_head(layer_config, vocabulary, lm_head.weight, config.seed)
    if INIT_FROM_TARGET:
        init_from_target(head, runner)
    fit(head, lm_head, train, test, config, INIT_FROM_TARGET)
    accuracy = held_out_accuracy(head, lm_head, test)
    folder_config = eagle_config_json(layer_config, True, base_model, None if vocabulary is None else len(vocabulary))
    folder_config["inferno_training"] = training_record(config, accuracy)
    return EagleFolder(folder_config, hf_tensors(head)), accuracy


def training_record(config: HeadTrainingConfig, accuracy: list[float]) -> dict:
    """What the folder's config.json keeps of the training: the recipe and the held-out top-1 per draft depth."""
    return {"unroll_steps": config.unroll_steps, "epochs": config.epochs, "learning_rate": config.learning_rate,
            "held_out_top1_per_depth": [round(a, 4) for a in accuracy]}


def frozen_linear(weight: torch.Tensor) -> torch.nn.Linear:
    """A frozen LM head of `weight` [rows, hidden] (bfloat16 where BF16_LM_HEAD)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = torch.nn.Parameter(weight.bfloat16() if BF16_LM_HEAD else weight.float(), requires_grad=False)
    return linear


def new_head(layer_config, vocabulary: torch.Tensor | None, lm_head_weight: torch.Tensor, seed: int) -> EagleHead:
    """A fresh float32 head: the target's LM head, or (a draft vocabulary) its own of those rows of the target's,
    frozen."""
    torch.manual_seed(seed)
    head = EagleHead(layer_config, fc_bias=True, own_lm_head=vocabulary is not None,
                     draft_vocab_size=None if vocabulary is None else len(vocabulary)).float()
    if vocabulary is not None:
        head.set_draft_vocabulary(vocabulary)
        head.lm_head.weight = torch.nn.Parameter(lm_head_weight[vocabulary].float(), requires_grad=False)
    return head


@torch.no_grad()
def init_from_target(head: EagleHead, runner: ModelRunner) -> None:
    """The head's layer as the target's last decoder layer (its input norm's weight folded into the q/k/v
    projection: the head's layer has none), the fc passing the feature half of its input through."""
    target = runner.model.layers[runner.config.num_hidden_layers - 1]
    layer, hidden = head.layers[0], head.config.hidden_size
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        mine = layer.get_submodule(name)
        weight, bias = dense_weight(runner, target.get_submodule(name), mine.in_features)
        mine.weight.copy_(weight)
        if mine.bias is not None:
            mine.bias.copy_(bias)
    layer.self_attn.qkv_proj.weight.mul_(target.input_layernorm.weight.float().cpu())
    layer.post_attention_layernorm.weight.copy_(target.post_attention_layernorm.weight.float().cpu())
    for norm in ("q_norm", "k_norm"):
        if getattr(layer.self_attn, norm, None) is not None:
            getattr(layer.self_attn, norm).weight.copy_(getattr(target.self_attn, norm).weight.float().cpu())
    head.fc.weight.zero_()
    head.fc.weight[:, hidden:] = torch.eye(hidden)
    head.fc.bias.zero_()


@torch.no_grad()
def match_residual_scale(head: EagleHead, examples: TrainingData) -> None:
    """Scales what a layer copied from the target adds to its input (the o and down projections) to fit the
    examples: the target's last layer adds to a residual stream far larger than the normalised features the head
    reads (its input norm hid that), so copied as is its additions swamp them. The scale is the least-squares one
    taking the head's input (the feature at p) towards the target's feature at p + 1, over the first 16 examples."""
    added = target = 0.0
    for embeds, features, kinds, next_features in examples.batches(1, count=16):
        kept = kinds != PADDING
        x = head.fc(torch.cat([embeds, features], -1))[kept]
        delta = head.forward_dense(embeds, features)[kept] - x
        added, target = added + float(delta.square().sum()), target + float((delta * (next_features[kept] - x)).sum())
    scale = max(target / max(added, 1e-30), 0.0)
    mlp, attn = head.layers[0].mlp, head.layers[0].self_attn
    attn.o_proj.weight *= scale
    mlp.down_proj.weight *= scale


def rms(tensors: Iterable[torch.Tensor]) -> float:
    squares = count = 0
    for t in tensors:
        squares, count = squares + float(t.double().square().sum()), count + t.numel()
    return (squares / count) ** 0.5


def normalised(data: TrainingData) -> TrainingData:
    """The examples with embeddings and features divided by their RMS (the features at p over every position but
    each sequence's last): the head trains on unit-scale inputs (raw, Qwen's post-norm features are ~400 times the
    embeddings, which the head then cannot see)."""
    return data.scaled(rms(data.embed(e.ids[1:]) for e in data.examples),
                       rms(e.features[:-1] for e in data.examples))


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


def loss_of(head: EagleHead, draft_lm_head: torch.nn.Module, batch, steps: int = 1) -> torch.Tensor:
    """Smooth L1 to the target's feature at p + 1, and cross entropy against its softmax there (over the draft
    vocabulary: renormalised on it), at each of `steps` unrolled draft steps (`EagleHead.forward_steps`: step j's
    positions from j - 1 on), step j's weighted STEP_DECAY ** (j - 1)."""
    embeds, features, kinds, next_features = batch
    with torch.no_grad():
        labels = logits_of(draft_lm_head, next_features).softmax(-1)
    loss = 0.0
    for step, out in enumerate(head.forward_steps(embeds, features, steps)):
        kept = kinds != PADDING
        kept[:, :step] = False
        out, target = out[kept], next_features[kept]
        loss = loss + STEP_DECAY ** step * (
            REGRESSION_WEIGHT * F.smooth_l1_loss(out, target)
            + CLASSIFICATION_WEIGHT * F.cross_entropy(logits_of(draft_lm_head, out), labels[kept]))
    return loss


def warmup_cosine(total_steps: int):
    """The learning rate's factor at each step: a linear warm-up, then a cosine down to 0."""
    warmup = max(1, round(WARMUP_FRACTION * total_steps))
    return lambda step: (step + 1) / warmup if step < warmup else \
        0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))


def fit(head: EagleHead, lm_head: torch.nn.Module, train: TrainingData, test: TrainingData,
        config: HeadTrainingConfig, from_target: bool = False) -> None:
    """Trains `head` on normalised examples (NORMALISED: the features and embeddings divided by their RMS), then
    folds the scales into its weights: it reads and writes the target's raw features. `lm_head`: the target's;
    `from_target`: the head was initialised from the target (`init_from_target`)."""
    if NORMALISED:
        train = normalised(train)
        test = test.scaled(train.embed_scale, train.feature_scale)
    if from_target:
        match_residual_scale(head, train)
    scaled = [frozen_linear(m.weight.float() * train.feature_scale) for m in (head.lm_head or lm_head, lm_head)]
    train_on(head, *scaled, train, test, config)
    fold_scales(head, train.embed_scale, train.feature_scale)


def train_on(head: EagleHead, draft_lm_head: torch.nn.Module, lm_head: torch.nn.Module, train: TrainingData,
             test: TrainingData, config: HeadTrainingConfig) -> None:
    """`draft_lm_head`: the head's (over the draft vocabulary), `lm_head`: the target's (for the held-out top-1)."""
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=config.learning_rate)
    longest = train.longest()
    per_step = max(1, config.batch_size // longest)  # batch_size counts positions
    steps_per_epoch = -(-len(train) // per_step)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.epochs * steps_per_epoch))
    generator = torch.Generator().manual_seed(config.seed)
    with tqdm(total=config.epochs * steps_per_epoch, desc="training an EAGLE head", dynamic_ncols=True) as bar:
        for _ in range(config.epochs):
            for batch in train.batches(per_step, generator):
                loss = loss_of(head, draft_lm_head, batch, config.unroll_steps)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
            accuracy = held_out_accuracy(head, lm_head, test, draft_lm_head)
            bar.set_postfix(loss=f"{loss.item():.3f}", held_out_top1_per_depth=" ".join(f"{a:.2f}" for a in accuracy))


@torch.no_grad()
def held_out_accuracy(head: EagleHead, lm_head: torch.nn.Module, test: TrainingData,
                      draft_lm_head: torch.nn.Module | None = None, depths: int = EVAL_DEPTHS) -> list[float]:
    """Per draft depth j = 1..`depths`, the fraction of held-out continuation positions (from j - 1 on) where the
    head's top-1 at unrolled step j is the target's own top-1 there: depth 1 teacher-forced (the first draft's
    greedy acceptance), deeper ones on the head's own features (a draft's acceptance where the drafts before it
    were the sequence's tokens). `lm_head`: the target's; `draft_lm_head`: the head's (default: its own, else the
    target's)."""
    draft_lm_head = draft_lm_head or head.lm_head or lm_head
    correct, total = [0] * depths, [0] * depths
    for embeds, features, kinds, next_features in test.batches(1):
        labels = logits_of(lm_head, next_features).argmax(-1)
        for step, out in enumerate(head.forward_steps(embeds, features, depths)):
            kept = kinds == CONTINUATION
            kept[:, :step] = False
            top1 = logits_of(draft_lm_head, out[kept]).argmax(-1)
            if head.draft_to_target is not None:
                top1 = head.draft_to_target[top1]
            correct[step] += int((top1 == labels[kept]).sum())
            total[step] += int(kept.sum())
    return [c / max(t, 1) for c, t in zip(correct, total)]


def hf_tensors(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's weights under the HF names of the folder (q/k/v and gate/up apart, rotate-half row order; a draft
    vocabulary as `d2t`)."""
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
    if head.draft_to_target is not None:  # vLLM's and SGLang's offsets: draft id i is target id i + d2t[i]
        tensors["d2t"] = head.draft_to_target.cpu() - torch.arange(len(head.draft_to_target))
    return tensors


def _rotate_half_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of `interleave_rotary_rows`."""
    out = w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    assert torch.equal(interleave_rotary_rows(out, num_heads), w)
    return out
