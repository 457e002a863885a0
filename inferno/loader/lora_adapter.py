"""A LoRA adapter read (PEFT folder or llama.cpp GGUF LoRA), checked against the base model, and laid out for the
model's fused projections: per (layer, stack), each output slice's A and scaled B in the model's row order."""
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from inferno.config import ModelConfig
from inferno.layers.rotary import interleave_rotary_rows
from inferno.lora_request import LoRARequest
from inferno.loader.lora_gguf import read_gguf_adapter
from inferno.loader.lora_peft import read_peft_adapter
from inferno.model.lora import TARGET_MODULES, check_supports_lora, lora_shapes

# PEFT's tensor names (with or without the `base_model.model.` wrapper)
TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
UNSUPPORTED = {"use_dora": "DoRA adapters", "modules_to_save": "modules_to_save (fully trained modules)",
               "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)"}

SlicePair = tuple[torch.Tensor, torch.Tensor]  # A [r, in], scaled B [out, r]


@dataclass
class LoRAAdapter:
    lora_int_id: int
    lora_name: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], list[SlicePair | None]]  # (layer, stack attribute) -> per output slice

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for pairs in self.weights.values() for pair in pairs if pair for t in pair)


def read_adapter_files(path: str, config: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """A `.gguf` file -> llama.cpp's LoRA reader (which needs the base's head counts to undo llama's Q/K row order);
    a folder -> PEFT's."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return read_gguf_adapter(path, config)
    if p.is_dir():
        return read_peft_adapter(path)
    raise ValueError(f"LoRA adapter path {path!r} does not exist or is neither a PEFT adapter folder nor a .gguf "
                     "file")


def load_lora_adapter(request: LoRARequest, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    adapter_config, tensors = read_adapter_files(request.lora_path, config)
    return lora_adapter(request, adapter_config, tensors, config, max_rank, dtype)


def lora_adapter(request: LoRARequest, adapter_config: dict, tensors: dict[str, torch.Tensor], config: ModelConfig,
                 max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Check the adapter against the model and lay it out (see the module docstring); ValueError says what is wrong."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    check_supports_lora(config)
    rank, scale = _rank_and_scale(adapter_config, max_rank, where)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = TENSOR_NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA A/B of a decoder projection (supported target "
                             f"modules: {', '.join(TARGET_MODULES)})")
        layer, block, module, kind = int(match[1]), match[2], match[3], match[4]
        if module not in TARGET_MODULES or TARGET_MODULES[module][0] != block:
            raise ValueError(f"{where}: target module {block}.{module} is not supported (supported: "
                             f"{', '.join(TARGET_MODULES)})")
        if layer >= config.num_hidden_layers:
            raise ValueError(f"{where}: tensor {name!r} is for layer {layer}, but the model has "
                             f"{config.num_hidden_layers} layers")
        pairs.setdefault((layer, module), {})[kind] = tensor
    if not pairs:
        raise ValueError(f"{where} has no LoRA tensors")
    shapes = lora_shapes(config)
    weights: dict[tuple[int, str], list[SlicePair | None]] = {}
    for (layer, module), pair in sorted(pairs.items()):
        _, attr, index = TARGET_MODULES[module]
        in_features, slices = shapes[attr]
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(pair)} but not "
                             f"lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (slices[index], rank):
            raise ValueError(f"{where}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but "
                             f"the base model needs A ({rank}, {in_features}) and B ({slices[index]}, {rank}) "
                             "(an adapter for another base model?)")
        b = b.float() * scale
        if module in ("q_proj", "k_proj"):  # the base's Q/K rows are in the interleaved rotary order (loader)
            b = interleave_rotary_rows(b, config.num_attention_heads if module == "q_proj"
                                       else config.num_key_value_heads)
        weights.setdefault((layer, attr), [None] * len(slices))[index] = (a.to(dtype).contiguous(),
                                                                          b.to(dtype).contiguous())
    return LoRAAdapter(request.lora_int_id, request.lora_name, rank, scale, weights)


def _rank_and_scale(adapter_config: dict, max_rank: int, where: str) -> tuple[int, float]:
    for key, what in UNSUPPORTED.items():
        if adapter_config.get(key):
            raise ValueError(f"{where}: {what} are not supported (adapter_config.json sets {key!r}); only the "
                             "low-rank A/B pairs of the decoder projections are")
    if adapter_config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {adapter_config['peft_type']!r} is not LORA")
    if adapter_config.get("bias", "none") != "none":
        raise ValueError(f"{where}: trained biases (bias={adapter_config['bias']!r}) are not supported")
    rank, alpha = adapter_config.get("r"), adapter_config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{where} has rank {rank}, above max_lora_rank={max_rank}; raise max_lora_rank "
                         "(--max-lora-rank)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    return rank, alpha / (math.sqrt(rank) if adapter_config.get("use_rslora") else rank)
