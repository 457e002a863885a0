"""Mixture-of-experts feed-forward block (mixtral, qwen2_moe, qwen3_moe, olmoe).

A router scores every expert per token; each token runs its `top_k` experts (softmax over all experts, the chosen
weights renormalised to sum to one with `norm_topk_prob`) and sums their outputs by those weights. Tokens are
grouped by expert and each expert runs once over its tokens, so an expert no token chose is never read (a batch-1
decode reads only `top_k` experts' weights). Experts are ordinary MLPs: weight quantization swaps their linears
like any other, and tensor parallelism splits their inner dimension like a dense MLP's, with one all-reduce for
the whole block. qwen2_moe adds a shared expert that every token runs, scaled by sigmoid(shared_expert_gate).
"""
import torch
import torch.nn.functional as F
from torch import nn

from inferno.config import ModelConfig
from inferno.distributed.parallel_state import ParallelRank
from inferno.layers.mlp import MLP


class Router(nn.Module):
    """Per-expert logits from a small float matrix: not an nn.Linear, so weight quantization leaves it exact."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's chosen experts [T, top_k] and their weights [T, top_k] (float32)."""
    probs = logits.float().softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


# CPU GEMMs with a few rows pack the whole weight first (slower than a matrix-vector product per row there):
# experts with at most this many tokens run them one by one
ROW_BY_ROW_MAX_TOKENS = 4


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelRank):
        super().__init__()
        moe = config.moe
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.parallel = parallel
        self.gate = Router(config.hidden_size, moe.num_experts)
        self.experts = nn.ModuleList(MLP(config.hidden_size, moe.intermediate_size, config.hidden_act, parallel,
                                         reduce=False) for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(config.hidden_size, moe.shared_expert_intermediate_size, config.hidden_act,
                                     parallel, reduce=False)
            self.shared_expert_gate = Router(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.norm_topk_prob)
        # (token, choice) pairs grouped by expert; each expert's weighted outputs land in its pairs' rows
        order = experts.flatten().argsort(stable=True)
        counts = torch.bincount(experts.flatten(), minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order].to(x.dtype).unsqueeze(1)
        grouped = x.new_empty(len(order), x.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                grouped[start:end] = self._run_expert(self.experts[expert], x, tokens[start:end])
                grouped[start:end] *= pair_weights[start:end]
                start = end
        pairs = torch.empty_like(grouped)
        pairs[order] = grouped  # back to (token, choice) order
        out = pairs.view(x.shape[0], self.top_k, -1).sum(dim=1)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.parallel.tp_size == 1 else self.parallel.all_reduce(out)

    @staticmethod
    def _run_expert(expert: MLP, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if len(tokens) > ROW_BY_ROW_MAX_TOKENS:
            return expert(x[tokens])
        return torch.cat([expert(x[token:token + 1]) for token in tokens.tolist()])
