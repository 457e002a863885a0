"""quantization="auto": a GGUF model computes with its own blocks, an AWQ / GPTQ model with its own 4-bit codes.
Each projection whose blocks the loader repacked runs them (4-bit groups through `Int4Linear`, Q4_K and Q6_K
super-blocks as stored through `Q4KLinear` and `Q6KLinear`, a fused projection of both through `ShardedLinear`, Q8
groups through `Q8Linear`), the token embedding stays quantized
(`QuantizedEmbedding`, `Q6KEmbedding`) and a tied LM head reads the same codes (an untied embedding stays the
file's blocks: `GGUFRowsEmbedding`); everything else stays float."""
from dataclasses import dataclass

import gguf
import torch
from torch import nn

from inferno.kernels import Q8_WITH_MINS
from inferno.layers.parallel_linear import GatheredRowParallel, RowParallelLinear
from inferno.layers.quantization.groups import GroupQuantized, PackedInt4, Q8Groups, ZeroPointInt4
from inferno.layers.quantization.int4 import Int4Linear
from inferno.layers.quantization.q4_k import Q4KBlocks, Q4KLinear
from inferno.layers.quantization.q6_k import Q6KBlocks, Q6KEmbedding, Q6KLinear
from inferno.layers.quantization.q8 import Q8Linear
from inferno.layers.quantization.super_blocks import ShardedLinear, SuperBlockLinear, SuperBlocks, SuperBlockShards
from inferno.layers.vocab_parallel import VocabParallelEmbedding


@dataclass
class GGUFRows:
    """A GGUF tensor's blocks as stored, of any type `gguf_to_q8` reads (gguf_repack.cpp), rows converted on use."""
    raw: torch.Tensor  # uint8 [rows, bytes per row]: a view of the file's memory map
    qtype: gguf.GGMLQuantizationType

    @property
    def shape(self) -> tuple[int, int]:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.raw.shape[0], self.raw.shape[1] // size * block

    def map_rows(self, fn) -> "GGUFRows":
        return GGUFRows(fn(self.raw), self.qtype)

    def q8_groups(self, rows: torch.Tensor | None = None) -> Q8Groups:
        """These rows (all by default) as Q8 groups, exactly."""
        raw = self.raw if rows is None else self.raw[rows]
        codes, scales, mins = torch.ops.inferno.gguf_to_q8(raw, int(self.qtype))
        return Q8Groups(codes, scales, mins if self.qtype in Q8_WITH_MINS else None)

    def dequantize(self) -> torch.Tensor:
        return self.q8_groups().dequantize()


NativeWeight = GGUFRows | GroupQuantized | PackedInt4 | SuperBlocks | SuperBlockShards | Q8Groups | ZeroPointInt4


class QuantizedEmbedding(nn.Module):
    """A lookup dequantizes only the rows it reads, so a 152k-token vocabulary never becomes a float matrix
    (152k x 1536 in float32 is 933 MB)."""

    def __init__(self, weight: Q8Groups, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.codes.shape
        self.dtype = dtype
        self.register_buffer("codes", weight.codes.contiguous())
        self.register_buffer("scales", weight.scales.float().contiguous())
        self.register_buffer("mins", None if weight.mins is None else weight.mins.float().contiguous())

    @property
    def q8_groups(self) -> Q8Groups:
        return Q8Groups(self.codes, self.scales, self.mins)

    def as_lm_head(self) -> Q8Linear:
        """A tied LM head reading the same codes."""
        return Q8Linear(self.q8_groups, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = Q8Groups(self.codes[input_ids], self.scales[input_ids],
                        None if self.mins is None else self.mins[input_ids])
        return rows.dequantize().to(self.dtype)


class GGUFRowsEmbedding(nn.Module):
    """An untied token embedding left as the file's blocks: a lookup converts only the rows it reads, so the
    vocabulary is neither copied nor converted at load (Qwen2.5-Coder-1.5B's Q4_K embedding: 152k rows, 290 MB as
    Q8 groups)."""

    def __init__(self, weight: GGUFRows, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.qtype = weight.qtype
        self.register_buffer("blocks", weight.raw)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = GGUFRows(self.blocks, self.qtype).q8_groups(input_ids.flatten()).dequantize().to(self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)


def load_native_layers(model: nn.Module, prequantized: dict[str, NativeWeight]) -> None:
    """Swap each layer named in `prequantized` (the loader's repacked checkpoint blocks, a tensor-parallel rank's
    part of them) for its native form."""
    for name, weight in prequantized.items():
        module = model.get_submodule(name)
        q6_k = isinstance(weight, Q6KBlocks)
        if name == "embed_tokens" and isinstance(weight, GGUFRows):
            install(model, name, GGUFRowsEmbedding(weight, module.weight.dtype))
        elif name == "embed_tokens":
            embedding = (Q6KEmbedding if q6_k else QuantizedEmbedding)(weight, module.weight.dtype)
            install(model, name, embedding)
            if model.config.tie_word_embeddings and model.lm_head is not None:
                install(model, "lm_head", embedding.as_lm_head())
        elif name == "lm_head":
            install(model, name, Q6KLinear(weight) if q6_k else Q8Linear(weight, module.weight.shape[1]))
        elif isinstance(weight, SuperBlocks):
            install(model, name, super_block_linear(weight, module.bias))
        elif isinstance(weight, SuperBlockShards):
            install(model, name, ShardedLinear([super_block_linear(p) for p in weight.parts], module.bias))
        elif isinstance(weight, (GroupQuantized, PackedInt4, ZeroPointInt4)):
            install(model, name, Int4Linear(weight, module.bias, input_width(module)))
        else:
            install(model, name, Q8Linear(weight, input_width(module), module.bias))


def install(model: nn.Module, name: str, layer: nn.Module) -> None:
    """`layer` in place of the model's layer `name`. Under tensor parallelism a vocabulary layer keeps its place and
    computes with `layer` (its rows), and a row-parallel one runs on the gathered input (`layer`: its output rows)."""
    old = model.get_submodule(name)
    if isinstance(old, VocabParallelEmbedding) and old.parallel.tp_size > 1:
        old.hold_quantized(layer)
    elif isinstance(old, RowParallelLinear) and old.runs_gathered:
        set_submodule(model, name, GatheredRowParallel(layer, old))
    else:
        set_submodule(model, name, layer)


def input_width(module: nn.Module) -> int:
    """The input features of the native layer that replaces `module`: all of them on gathered input rows."""
    gathered = isinstance(module, RowParallelLinear) and module.runs_gathered
    return module.full_in_features if gathered else module.in_features


def super_block_linear(weight: SuperBlocks, bias: torch.Tensor | None = None) -> SuperBlockLinear:
    return (Q4KLinear if isinstance(weight, Q4KBlocks) else Q6KLinear)(weight, bias)


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)
