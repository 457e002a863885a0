"""What every attention backend offers the model runner and the `Attention` layers: step metadata built from the
flat batch (or, for a compiled or captured decode step, from tensors), one call per layer, and which kind of fast
decode step it can run."""
from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class AttentionBackend(ABC):
    name: ClassVar[str]
    # which fast decode step the runner may build over it: a torch.compile'd forward (CPU), CUDA graphs (GPU)
    compiles_decode_step: ClassVar[bool] = False
    captures_decode_graphs: ClassVar[bool] = False
    # whether a prefill chunk with nothing cached before it attends to its own K/V as computed, not through the
    # cache: then the planner may leave out the K/V writes no later step reads (`MicroBatch.slot_mapping`)
    prefill_reads_new_kv: ClassVar[bool] = False
    # whether decode rows may hide keys from one another (`build_metadata`'s tree_hidden_keys): draft trees
    masks_tree_keys: ClassVar[bool] = True

    @abstractmethod
    def build_metadata(self, slot_mapping: list[int], decodes: list[tuple[int, list[int]]],
                       prefills: list[tuple[int, int, list[int]]], tree_hidden_keys: dict[int, list[int]] | None = None):
        """The step's metadata. decodes: per decode row (sequence length, block ids); prefills: per chunk (tokens,
        tokens already cached, block ids), after the decode rows in the flat batch; tree_hidden_keys: per decode row
        of a draft tree, the positions below its sequence length it must not see (other branches of its tree)."""

    @abstractmethod
    def decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor):
        """Decode rows only, from tensors (what a compiled or captured decode step traces)."""

    @abstractmethod
    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """Writes the step's new K/V into the layer's cache (rows with a slot: the first len(slot_mapping)) and
        attends: q [T, H, D] -> [T, H * D]."""
