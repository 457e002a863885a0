"""Hugging Face folders quantized by AWQ or GPTQ (4 bits): each layer's packed int32 tensors unpacked into its
integer codes, float16 scales and integer zero points (`ZeroPointInt4`, w = (code - zero) * scale), which the int4
kernel runs as they are. Nothing is dequantized and quantized again.

- AWQ GEMM (`quant_method: awq`, `version: gemm`, `zero_point: true`): `qweight` int32 [in, out / 8] and `qzeros`
  int32 [in / group, out / 8], eight 4-bit values per int32 along the output features in AWQ's order (nibble i,
  bits 4i..4i+3, holds output 8c + AWQ_ORDER[i]); `scales` float16 [in / group, out].
- GPTQ (`quant_method: gptq`): `qweight` int32 [in / 8, out], eight values along the input features (nibble i of
  row r: input 8r + i); `qzeros` int32 [in / group, out / 8] along the output features in plain order, holding
  zero - 1 in the original ("gptq", v1) checkpoint format and the zero itself in "gptq_v2"; `scales` float16
  [in / group, out]; `g_idx` int32 [in], each input's group. Act-order checkpoints (`desc_act: true`) permute the
  inputs' groups; those load only when g_idx is the plain order after all (input i in group i // group_size).
"""
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from inferno.layers.quantization.groups import ZeroPointInt4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds output 8c + AWQ_ORDER[i]
GROUP_SIZES = (32, 64, 128)  # what the int4 kernel's groups hold
PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    method: str  # "awq" | "gptq"
    group_size: int
    zero_offset: int  # added to each stored zero: 1 for GPTQ's v1 format, else 0
    desc_act: bool = False


def read_quantization(cfg: dict) -> CheckpointQuantization | None:
    """config.json's `quantization_config`, checked: None for a float checkpoint."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in PARTS:
        raise ValueError(f"quantization_config quant_method {method!r} is not supported (supported: awq, gptq)")
    bits = qc.get("bits", qc.get("w_bit"))
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with {bits} bits are not supported (only 4 bits)")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{method} group_size {group_size} is not supported (supported: {list(GROUP_SIZES)})")
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"AWQ version {qc['version']!r} is not supported (only 'gemm')")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points (zero_point: false) are not supported")
        return CheckpointQuantization("awq", group_size, 0)
    checkpoint_format = qc.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported (supported: gptq, gptq_v2)")
    return CheckpointQuantization("gptq", group_size, 1 if checkpoint_format == "gptq" else 0,
                                  bool(qc.get("desc_act", False)))


def nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 [..., n, ...] -> uint8 with the 8 nibbles of each value spread along `dim` (n * 8), nibble i (bits
    4i..4i+3) at 8j + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    values = (packed.unsqueeze(dim + 1) >> shifts.view(-1, *[1] * (packed.dim() - dim - 1))) & 0xF
    return values.flatten(dim, dim + 1).to(torch.uint8)


def awq_order(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., out] in AWQ's nibble order -> output order."""
    order = torch.tensor(AWQ_ORDER)
    position = torch.empty_like(order)
    position[order] = torch.arange(8)  # output 8c + o sits at nibble position[o]
    columns = (torch.arange(values.shape[-1]) // 8 * 8).view(-1, 8) + position
    return values[..., columns.flatten()]


def unpack_layer(name: str, parts: dict[str, torch.Tensor], quant: CheckpointQuantization) -> ZeroPointInt4:
    """One layer's packed tensors -> its codes [out, in], scales and zero points [out, in / group]."""
    scales = parts["scales"].to(torch.float16)
    groups, out_features = scales.shape
    if quant.method == "awq":
        codes = awq_order(nibbles(parts["qweight"], 1))  # [in, out]
        zeros = awq_order(nibbles(parts["qzeros"], 1))
    else:
        codes = nibbles(parts["qweight"], 0)  # [in, out]
        zeros = nibbles(parts["qzeros"], 1) + quant.zero_offset
        plain = torch.arange(codes.shape[0]) // quant.group_size
        if not torch.equal(parts["g_idx"].long(), plain):
            raise ValueError(f"GPTQ layer {name!r} is quantized with act-order (desc_act: true): its g_idx assigns "
                             "input features to groups out of order, which the int4 kernel's contiguous groups cannot "
                             "hold; use a checkpoint quantized with desc_act: false")
    in_features = codes.shape[0]
    if codes.shape[1] != out_features or zeros.shape != (groups, out_features) or in_features != groups * quant.group_size:
        raise ValueError(f"{quant.method} layer {name!r}: qweight, qzeros and scales do not fit one [{out_features}, "
                         f"{in_features}] weight in groups of {quant.group_size}")
    return ZeroPointInt4(codes.t().contiguous(), scales.t().contiguous(), zeros=zeros.t().contiguous())


def group_layers(weights: Iterable[tuple[str, torch.Tensor]], quant: CheckpointQuantization, native: bool
                 ) -> Iterator[tuple[str, torch.Tensor | ZeroPointInt4]]:
    """Float tensors as they are; each quantized layer's parts, once all have come, as `<layer>.weight`: its
    ZeroPointInt4 (`native`) or that dequantized to float32."""
    parts = PARTS[quant.method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in weights:
        layer, _, part = name.rpartition(".")
        if part not in parts:
            yield name, w
            continue
        pending.setdefault(layer, {})[part] = w
        if len(pending[layer]) == len(parts):
            weight = unpack_layer(layer, pending.pop(layer), quant)
            yield f"{layer}.weight", weight if native else weight.dequantize()
    if pending:
        layer, got = next(iter(pending.items()))
        raise ValueError(f"{quant.method} layer {layer!r} lacks {', '.join(p for p in parts if p not in got)}")
