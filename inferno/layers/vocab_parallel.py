"""Vocabulary-parallel token embedding and LM head: each tensor-parallel rank holds a contiguous slice of the
vocabulary's rows (padded with zero rows to an equal size on every rank). A quantized model hands each its rows in
a quantized module instead (`hold_quantized`: a lookup for the embedding, a linear layer for the head)."""
import torch
import torch.nn.functional as F
from torch import nn

from inferno.distributed.parallel_state import ParallelRank
from inferno.layers.packed_linear import linear
from inferno.layers.parallel_linear import check_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelRank):
        super().__init__()
        self.vocab_size = vocab_size
        self.parallel = parallel
        self.rows_per_rank = -(-vocab_size // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))
        self.quantized: nn.Module | None = None

    @property
    def vocab_rows(self) -> range:
        return range(self.vocab_start, self.vocab_end)

    def weight_loader(self, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        check_shape(name, loaded, (self.vocab_size, param.shape[1]))
        held = self.vocab_end - self.vocab_start
        param.data[:held].copy_(loaded[self.vocab_start:self.vocab_end])
        param.data[held:].zero_()

    def hold_quantized(self, rows: nn.Module) -> None:
        """Compute with `rows`, a quantized module of this rank's `vocab_rows`, instead of the float weight."""
        del self.weight
        self.quantized = rows

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight) if self.quantized is None else self.quantized(input_ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self.embed(input_ids)
        local_ids = input_ids - self.vocab_start
        elsewhere = (local_ids < 0) | (local_ids >= self.vocab_end - self.vocab_start)
        x = self.embed(local_ids.masked_fill(elsewhere, 0))
        x.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.parallel.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary slice, gathered on tensor rank 0 (where sampling happens)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = linear(hidden, self.weight) if self.quantized is None else self.quantized(hidden)
        if self.parallel.tp_size == 1:
            return logits
        # quantized rows are not padded: every rank's part padded to rows_per_rank for the gather
        logits = F.pad(logits, (0, self.rows_per_rank - logits.shape[-1]))
        parts = self.parallel.gather_to_first(logits)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :self.vocab_size]
