"""LoRA adapters batched on one base model: each projection that adapters may target gets a `LoRAStack`, the A and
B matrices of every adapter slot stacked, and each token row of a step names its slot (`LoRAMapping`). Slot 0 is
"no adapter" (its matrices stay zero). The base weights are never touched: the stack's product is added to the base
layer's output, whatever the base layer is (float, GGUF blocks, int8 / int4, AWQ / GPTQ)."""
from dataclasses import dataclass

import torch
from torch import nn

from inferno.layers.fused_cpu import cpu_fused_ops

# Above this many token rows (prefill chunks) the product runs per adapter segment on that segment's rows; at or
# below it (decode steps, the compiled graph) one product with no data-dependent shapes: the native kernel on the
# CPU, else the masked product over all slots. Measured by benchmarks/lora_kernels.py (docs/lora.md).
SEGMENTED_FROM_ROWS = 64


@dataclass(slots=True)
class LoRAMapping:
    """Per token row of a step: the adapter slot it runs with (0: none). `segments`: per slot in use, the rows that
    run with it (eager steps with many rows; None: one product over all rows)."""
    token_slots: torch.Tensor  # [T] long
    segments: list[tuple[int, torch.Tensor]] | None = None

    @classmethod
    def of(cls, token_slots: list[int], device: torch.device) -> "LoRAMapping":
        slots = torch.tensor(token_slots, dtype=torch.long, device=device)
        if len(token_slots) <= SEGMENTED_FROM_ROWS:
            return cls(slots)
        used = sorted(set(token_slots) - {0})
        return cls(slots, [(s, (slots == s).nonzero().squeeze(1)) for s in used])


class LoRAStack(nn.Module):
    """The adapters of one projection, whose output may be several slices (fused q/k/v or gate/up: `slice_sizes`),
    each adapted by its own pair: A [slots, slices * max_rank, in] (slice i's A in rows i*max_rank..), B transposed
    [slots, slices * max_rank, out] (slice i's B^T in those rows and its own output columns, zero elsewhere), so one
    shrink and one expand compute every slice. Ranks below max_rank are zero-padded; the scale is folded into B."""

    def __init__(self, in_features: int, slice_sizes: list[int], num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.slice_sizes, self.max_rank = slice_sizes, max_rank
        self.slice_offsets = [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]
        width = len(slice_sizes) * max_rank
        self.register_buffer("lora_a", torch.zeros(num_slots, width, in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(num_slots, width, sum(slice_sizes), dtype=dtype, device=device))

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter into `slot`: per slice, (A [r, in], scaled B [out_slice, r]) or None (not adapted)."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        for i, pair in enumerate(pairs):
            if pair is None:
                continue
            lora_a, lora_b = pair
            r, row, col = lora_a.shape[0], i * self.max_rank, self.slice_offsets[i]
            a[row:row + r].copy_(lora_a)
            b[row:row + r, col:col + self.slice_sizes[i]].copy_(lora_b.t())

    def forward(self, x: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """The adapters' part of the projection of x [T, in]: [T, out], zero for rows without an adapter."""
        if mapping.segments is not None:
            return self._segmented(x, mapping.segments)
        if (ops := cpu_fused_ops(x)) is not None:
            return self._native(ops, x, mapping.token_slots)
        return self._masked(x, mapping.token_slots)

    def _native(self, ops, x: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        """kernels/lora_bgmv.cpp: the rows grouped per slot, reading only the slots they use and each slice's B in its
        own columns (punica's BGMV idea)."""
        return ops.lora_bgmv(x.contiguous(), self.lora_a, self.lora_b, token_slots, self.slice_sizes)

    def _masked(self, x: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        """Every slot's shrink for every row, the other slots' columns zeroed, then one expand: two GEMMs whose
        inner size is slots x slices x max_rank, with no gather and no data-dependent shape."""
        a, b = self.lora_a[1:], self.lora_b[1:]  # slot 0 is zero
        num_slots, width = a.shape[0], a.shape[1]
        shrunk = (x @ a.reshape(num_slots * width, -1).t()).view(-1, num_slots, width)
        own = token_slots[:, None] == torch.arange(1, num_slots + 1, device=x.device)
        shrunk = shrunk * own[:, :, None].to(shrunk.dtype)
        return shrunk.view(-1, num_slots * width) @ b.reshape(num_slots * width, -1)

    def _segmented(self, x: torch.Tensor, segments: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """Per slot in use, its rows through its own A and B (SGMV's idea, with index_select and two GEMMs)."""
        out = x.new_zeros(x.shape[0], self.lora_b.shape[2])
        for slot, rows in segments:
            out.index_add_(0, rows, (x.index_select(0, rows) @ self.lora_a[slot].t()) @ self.lora_b[slot])
        return out


def add_lora(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack | None, mapping: LoRAMapping | None) -> torch.Tensor:
    """A projection's output y = base(x) plus its adapters' part, when the step runs adapters."""
    if mapping is None or stack is None:
        return y
    x2 = x.reshape(-1, x.shape[-1]).to(stack.lora_a.dtype)
    return y + stack(x2, mapping).view(y.shape).to(y.dtype)
