"""Decode-only steps replayed from CUDA graphs (GPU only).

The model's forward over one decode token per request is captured at start-up for a set of padded batch sizes
(largest first, sharing one memory pool, within a time budget) and replayed with the step's inputs copied into the
graphs' static buffers: one launch per step instead of hundreds. Rows beyond the step's batch are padding: they
write no K/V (slot -1) and attend one key of whatever block their table row holds. Steps with prefills, batches
beyond the largest size, and block tables wider than the captured ones run eagerly.
"""
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger("inferno")

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
CAPTURE_TIME_BUDGET = 60.0  # seconds of start-up spent capturing at most; the sizes left out run eagerly

# (input_ids, positions, slot_mapping, block_tables, seq_lens) -> hidden states
DecodeForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def padded_size(batch: int, sizes) -> int | None:
    """The smallest captured size that holds `batch` rows (None: none does)."""
    return min((s for s in sizes if s >= batch), default=None)


class DecodeGraphs:
    def __init__(self, forward: DecodeForward, max_batch: int, max_blocks_per_seq: int, scratch_block: int,
                 device: torch.device, time_budget: float = CAPTURE_TIME_BUDGET):
        sizes = [s for s in CAPTURE_SIZES if s <= max_batch]
        n = max(sizes)
        self.width = max_blocks_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, self.width), scratch_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        for size in sorted(sizes, reverse=True):
            if time.perf_counter() - start > time_budget:
                logger.warning("CUDA graphs: capture budget of %.0f s spent; batches of up to %d run eagerly",
                               time_budget, size)
                break
            inputs = self._inputs(size)
            forward(*inputs)  # warm-up: Triton compiles its kernels outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = forward(*inputs)
            self.graphs[size] = graph
        logger.info("CUDA graphs: decode steps of %s rows captured in %.1f s", sorted(self.graphs),
                    time.perf_counter() - start)

    def _inputs(self, size: int) -> tuple[torch.Tensor, ...]:
        return (self.input_ids[:size], self.positions[:size], self.slot_mapping[:size], self.block_tables[:size],
                self.seq_lens[:size])

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            decodes: list[tuple[int, list[int]]]) -> torch.Tensor | None:
        """Hidden states [batch, hidden] of a decode-only step, or None when no captured graph fits it."""
        batch = len(input_ids)
        size = padded_size(batch, self.graphs)
        if size is None or max(len(table) for _, table in decodes) > self.width:
            return None
        device = self.input_ids.device
        self.input_ids[:batch].copy_(torch.tensor(input_ids), non_blocking=True)
        self.positions[:batch].copy_(torch.tensor(positions), non_blocking=True)
        self.slot_mapping[:batch].copy_(torch.tensor(slot_mapping), non_blocking=True)
        self.slot_mapping[batch:size].fill_(-1)
        tables = torch.zeros(batch, self.width, dtype=torch.int32)
        for row, (_, table) in enumerate(decodes):
            tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
        self.block_tables[:batch].copy_(tables.to(device, non_blocking=True))
        self.seq_lens[:batch].copy_(torch.tensor([n for n, _ in decodes], dtype=torch.int32), non_blocking=True)
        self.seq_lens[batch:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:batch]
