"""Vocabulary-parallel token embedding and LM head: each tensor-parallel rank holds a contiguous slice of the
vocabulary's rows (padded with zero rows to an equal size on every rank)."""
import torch
import torch.nn.functional as F
from torch import nn

from inferno.distributed.parallel_state import ParallelRank
from inferno.layers.parallel_linear import check_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelRank):
        super().__init__()
        self.vocab_size = vocab_size
        self.parallel = parallel
        rows_per_rank = -(-vocab_size // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * rows_per_rank
        self.vocab_end = min(self.vocab_start + rows_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(rows_per_rank, hidden_size))

    def weight_loader(self, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        check_shape(name, loaded, (self.vocab_size, param.shape[1]))
        held = self.vocab_end - self.vocab_start
        param.data[:held].copy_(loaded[self.vocab_start:self.vocab_end])
        param.data[held:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        elsewhere = (local_ids < 0) | (local_ids >= self.vocab_end - self.vocab_start)
        x = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        x.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.parallel.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary slice, gathered on tensor rank 0 (where sampling happens)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden, self.weight)
        if self.parallel.tp_size == 1:
            return logits
        parts = self.parallel.gather_to_first(logits)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :self.vocab_size]
