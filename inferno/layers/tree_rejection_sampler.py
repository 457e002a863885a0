"""Exact verification of a tree of drafts (SpecInfer's multi-candidate rule, the one EAGLE uses for its trees).

The target scores every node of a request's tree in one pass: p_n is its distribution for the token after node n
(node 0: the request's last token), every sampling parameter applied. Verification walks down from the root. At a
node, with r = p_n, its children's tokens x_1, x_2, ... are tried in turn: x_i is accepted with probability
r(x_i) / sum(r), and on a rejection its mass is removed from r (r(x_i) = 0). The walk moves to an accepted child
and starts over with that child's p; when every child is rejected (or the node is a leaf) one token is sampled
from what is left of r and the walk ends. Whatever the candidates are, the token leaving a node is distributed
exactly as p_n (each tried token is emitted with probability p_n(x), the rest keeps p_n's proportions), so the
output is the target's. Candidates count as point masses: a drafter's distribution is not needed, and a drafter
that proposes its top-k (Medusa, EAGLE-2) is verified exactly. Greedy requests follow the child equal to the
target's argmax while there is one, then emit the argmax: the longest root-to-leaf prefix matching the target.
"""
from dataclasses import dataclass

import torch

from inferno.core.spec_tree import SpecTree
from inferno.layers.sampler import SamplingMetadata, process_logits, random_sample


@dataclass(slots=True)
class TreeDrafts:
    token_ids: list[int]  # nodes 1..k (the tree's layout order)
    tree: SpecTree
    generator: torch.Generator | None  # the request's own generator (seeded requests)


@dataclass(slots=True)
class TreeVerdict:
    token_ids: list[int]  # emitted: the accepted drafts, then one sampled token
    accepted_nodes: list[int]  # the root, then each accepted node (the path whose K/V is kept)


def tree_rejection_sample(logits: torch.Tensor, md: SamplingMetadata,
                          drafts: list[TreeDrafts]) -> list[TreeVerdict]:
    """logits: [sum(1 + k_i), vocab], request i's rows consecutive in node order; `md` one row per logits row."""
    logits, greedy = process_logits(logits, md)
    probs = None if md.all_greedy else logits.softmax(dim=-1)
    greedy_ids, verdicts, first = greedy.tolist(), [], 0
    for d in drafts:
        if md.temperature[first] == 0:
            verdicts.append(_walk_greedy(d, greedy_ids[first:first + d.tree.num_nodes]))
        else:
            verdicts.append(_walk_sampled(d, probs[first:first + d.tree.num_nodes]))
        first += d.tree.num_nodes
    return verdicts


def _walk_greedy(d: TreeDrafts, argmax: list[int]) -> TreeVerdict:
    children, node, path = d.tree.children(), 0, [0]
    while True:
        match = next((child for child in children[node] if d.token_ids[child - 1] == argmax[node]), None)
        if match is None:
            return TreeVerdict([d.token_ids[n - 1] for n in path[1:]] + [argmax[node]], path)
        node = match
        path.append(node)


def _walk_sampled(d: TreeDrafts, probs: torch.Tensor) -> TreeVerdict:
    """probs: [nodes, vocab], the target's p_n of each node."""
    children, node, path = d.tree.children(), 0, [0]
    while True:
        residual = probs[node].clone()
        accepted = None
        for child in children[node]:
            token = d.token_ids[child - 1]
            uniform = torch.rand((), generator=d.generator, device=probs.device)
            if uniform * residual.sum() < residual[token]:  # u < r(x) / sum(r)
                accepted = child
                break
            residual[token] = 0.0
        if accepted is None:
            if residual.sum() <= 0:  # the rejected tokens held all of p up to rounding
                residual = probs[node].clone()
            final = random_sample(residual.unsqueeze(0), {} if d.generator is None else {0: d.generator})
            return TreeVerdict([d.token_ids[n - 1] for n in path[1:]] + [int(final)], path)
        node = accepted
        path.append(node)
