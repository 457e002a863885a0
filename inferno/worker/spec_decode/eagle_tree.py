"""Token trees as an EAGLE head drafts them, depth by depth, on its own paged KV cache.

The head's pass for position p reads the token at p + 1, so a request's root is the pass at the position before
its last token (slot r = n - 2 for n tokens: the catch-up's last), whose output ranks the first drafts. A node that
gets children runs a pass of its own, over its token at position r + its depth, whose output ranks them. Those
passes take the slots after the root's, one each in the order they run (`passes`), so a tree needs as many slots
past the root as it has inner nodes, not one per node; each attends to the context and to its ancestors' passes,
the slots of earlier other branches hidden. Nothing of them outlives the proposal: the next one rewrites every slot
past the request's last token from the target's features (ProposerCache).

Two shapes: a static tree (`speculative_token_tree` as a list of paths of ranks, as Medusa's), and EAGLE-2's
dynamic tree (Li et al. 2024, "EAGLE-2"), which at each depth expands the `topk` nodes of best cumulative draft
log-probability, each into its `topk` best tokens, then keeps the best `num_drafts` nodes of all it drafted (a
child never scores above its parent, so they form a tree)."""
from collections.abc import Sequence

from inferno.core.spec_tree import SpecTree, tree_of_paths


class DraftTree:
    """A request's tree as its head grows it: its tokens on `shape` (node 0 the root), and the slots of its passes."""

    width: int  # how many of a pass's top tokens `grow` reads

    def __init__(self, shape: SpecTree) -> None:
        self.shape = shape
        self.token_ids = [0] * shape.num_nodes  # the root's is not drafted
        self.passes: list[int] = []  # the nodes given a pass, in order: pass j writes slot root + 1 + j

    def pass_slot(self, node: int, root: int) -> int:
        return root + 1 + self.passes.index(node)

    def hidden_slots(self, node: int, root: int) -> list[int]:
        """The slots of earlier passes that `node`'s pass must not see (other branches)."""
        visible = set(self.shape.ancestors(node))
        return [root + 1 + j for j, other in enumerate(self.passes[:self.passes.index(node)]) if other not in visible]

    def grow(self, node: int, top_ids: list[int], top_logprobs: list[float]) -> None:
        """`node`'s children from its pass's top tokens (best first) and their log-probabilities."""
        raise NotImplementedError

    def expand(self) -> list[int]:
        """The nodes whose passes run next (added to `passes`); none once the tree is drafted."""
        raise NotImplementedError

    def drafts(self) -> tuple[list[int], list[int]]:
        """The drafted tree: its tokens and their parents (0: the root), each node after its parent."""
        raise NotImplementedError


class StaticTree(DraftTree):
    def __init__(self, token_tree: Sequence[tuple[int, ...]], depth: int, num_slots: int):
        """`token_tree` (paths of ranks sorted by length, then ranks) up to `depth`, its inner nodes' passes in the
        first `num_slots` slots after the root's (the nodes under the others dropped)."""
        paths = [path for path in token_tree if len(path) <= depth]
        parents = {path[:-1] for path in paths}
        inner = [path for path in paths if path in parents]
        kept = set(inner[:num_slots]) | {()}
        nodes = [path for path in paths if path[:-1] in kept]
        super().__init__(tree_of_paths(nodes))
        self.ranks = [0] + [path[-1] for path in nodes]
        self.children = self.shape.children()
        self.width = max(self.ranks) + 1
        self._depth = 0

    def grow(self, node: int, top_ids: list[int], top_logprobs: list[float]) -> None:
        for child in self.children[node]:
            self.token_ids[child] = top_ids[self.ranks[child]]

    def expand(self) -> list[int]:
        self._depth += 1
        depths = self.shape.depths()
        nodes = [n for n in range(1, self.shape.num_nodes) if depths[n] == self._depth and self.children[n]]
        self.passes += nodes
        return nodes

    def drafts(self) -> tuple[list[int], list[int]]:
        return self.token_ids[1:], list(self.shape.parents)


class DynamicTree(DraftTree):
    def __init__(self, topk: int, num_drafts: int, depth: int):
        super().__init__(SpecTree(()))
        self.width, self.num_drafts, self.max_depth = topk, num_drafts, depth
        self.scores = [0.0]  # cumulative draft log-probabilities
        self._newest: list[int] = []  # the last depth's nodes

    def grow(self, node: int, top_ids: list[int], top_logprobs: list[float]) -> None:
        children = list(zip(top_ids[:self.width], top_logprobs))
        first = self.shape.num_nodes
        self.shape = SpecTree(self.shape.parents + (node,) * len(children))
        self.token_ids += [token_id for token_id, _ in children]
        self.scores += [self.scores[node] + logprob for _, logprob in children]
        self._newest += range(first, self.shape.num_nodes)

    def expand(self) -> list[int]:
        newest, self._newest = self._newest, []
        if not newest or self.shape.depths()[newest[0]] >= self.max_depth:
            return []
        nodes = sorted(newest, key=lambda n: -self.scores[n])[:self.width]
        self.passes += nodes
        return nodes

    def drafts(self) -> tuple[list[int], list[int]]:
        depths = self.shape.depths()
        best = sorted(range(1, self.shape.num_nodes), key=lambda n: (-self.scores[n], depths[n]))
        kept = sorted(best[:self.num_drafts], key=lambda n: (depths[n], n))  # parents first
        order = {0: 0} | {node: i for i, node in enumerate(kept, start=1)}
        return [self.token_ids[n] for n in kept], [order[self.shape.parent(n)] for n in kept]
