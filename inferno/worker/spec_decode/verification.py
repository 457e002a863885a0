"""Verifying a step's drafts on rank 0: a chain's by rejection sampling, a tree's by the walk down it
(layers/tree_rejection_sampler.py). A tree asks more of the worker: each node's sampling context (the drafts on
its path) and, after the walk, the accepted path's K/V moved from the slots the tree's layout gave its nodes to
the consecutive positions the sequence now has (the other branches' slots are then past the sequence's end,
overwritten by its next tokens)."""
import torch

from inferno.core.kv_blocks import cdiv
from inferno.core.scheduler_output import ModelRunnerOutput
from inferno.core.spec_tree import SpecTree
from inferno.layers.attention.layer import Attention
from inferno.layers.rejection_sampler import Drafts, rejection_sample
from inferno.layers.tree_rejection_sampler import TreeDrafts, tree_rejection_sample
from inferno.worker.input_batch import StepPlan
from inferno.worker.request_state import CachedRequestState
from inferno.worker.sampling_metadata import sampling_metadata

Speculation = tuple[CachedRequestState, list[int], object, list[int]]  # request, drafts, probs or tree, logit rows


def verify_drafts(plan: StepPlan, logits: torch.Tensor, out: ModelRunnerOutput, bitmasks: dict[str, torch.Tensor],
                  vocab_size: int, layers: list[Attention], block_size: int) -> dict[str, list[int]]:
    """Target logits at all 1 + k positions of each speculating request -> the tokens each emits, into `out`.
    Returns, per request whose drafts were a tree, the nodes it kept (whose K/V are now in place)."""
    chains, trees, first = [], [], 0
    for req, tokens, probs, tree in zip(plan.spec_requests, plan.spec_token_ids, plan.spec_draft_probs,
                                        plan.spec_trees):
        rows = plan.spec_rows[first:first + len(tokens) + 1]
        first += len(rows)
        (chains if tree is None else trees).append((req, tokens, probs if tree is None else tree, rows))
    if chains:
        _verify_chains(chains, logits, out, bitmasks, vocab_size)
    return _verify_trees(trees, logits, out, bitmasks, vocab_size, layers, block_size) if trees else {}


def _verify_chains(chains: list[Speculation], logits: torch.Tensor, out: ModelRunnerOutput,
                   bitmasks: dict[str, torch.Tensor], vocab_size: int) -> None:
    metadata_rows, drafts, row_bitmasks, rows = [], [], [], []
    for req, tokens, probs, request_rows in chains:
        metadata_rows.extend((req, tokens[:j]) for j in range(len(tokens) + 1))
        drafts.append(Drafts(tokens, probs, req.generator))
        bitmask = bitmasks.get(req.request_id)
        row_bitmasks.extend([None] * (len(tokens) + 1) if bitmask is None else bitmask)
        rows += request_rows
    md = sampling_metadata(metadata_rows, vocab_size, row_bitmasks, logits.device)
    for (req, *_), tokens in zip(chains, rejection_sample(logits[rows], md, drafts)):
        out.sampled_token_ids[req.request_id] = tokens


def _verify_trees(trees: list[Speculation], logits: torch.Tensor, out: ModelRunnerOutput,
                  bitmasks: dict[str, torch.Tensor], vocab_size: int, layers: list[Attention],
                  block_size: int) -> dict[str, list[int]]:
    if any(req.request_id in bitmasks for req, *_ in trees):
        raise NotImplementedError("a grammar-constrained request's drafts must be a chain, not a tree")
    metadata_rows, rows = [], []
    for req, tokens, tree, request_rows in trees:
        metadata_rows.extend((req, drafts) for drafts in drafts_before_each_node(tokens, tree))
        rows += request_rows
    md = sampling_metadata(metadata_rows, vocab_size, device=logits.device)
    drafts = [TreeDrafts(tokens, tree, req.generator) for req, tokens, tree, _ in trees]
    accepted = {}
    for (req, *_), verdict in zip(trees, tree_rejection_sample(logits[rows], md, drafts)):
        out.sampled_token_ids[req.request_id] = verdict.token_ids
        accepted[req.request_id] = verdict.accepted_nodes
        move_accepted_kv(layers, req, block_size, verdict.accepted_nodes)
    return accepted


def drafts_before_each_node(tokens: list[int], tree: SpecTree) -> list[list[int]]:
    """Per node, the drafts on its path from the root (what penalties and min_tokens see as output so far)."""
    return [[tokens[node - 1] for node in tree.ancestors(n)[1:]] for n in range(tree.num_nodes)]


def move_accepted_kv(layers: list[Attention], req: CachedRequestState, block_size: int,
                     accepted_nodes: list[int]) -> None:
    """The accepted nodes' K/V (node n at position root + n) to positions root, root + 1, ... of `req`, whose last
    token (not counting the drafts) is the root. Node indices grow along a path, so no move overwrites a node
    still to move."""
    root = req.num_tokens - 1
    moves = [(root + node, root + depth) for depth, node in enumerate(accepted_nodes) if node != depth]
    if not moves:
        return
    assert cdiv(moves[-1][0] + 1, block_size) <= len(req.block_ids)
    slots = [[req.block_ids[p // block_size] * block_size + p % block_size for p in positions]
             for positions in zip(*moves)]
    sources, destinations = torch.tensor(slots, dtype=torch.long, device=layers[0].k_cache.device)
    for layer in layers:
        layer.move_slots(sources, destinations)
