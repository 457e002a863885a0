"""A tree of draft tokens (speculative decoding): the shape every rank reads alike.

Node 0 is the request's last token (the root, not a draft); nodes 1..k are the drafts in the order they are laid
out in the step, each after its parent: `parents[i - 1]` is the parent of node i (0: the root). A node's depth is
its distance from the root: its position is the root's plus its depth, and it attends to the context before the
root and to its own ancestors only (a chain is the tree whose parents are 0, 1, ..., k - 1).
"""
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecTree:
    parents: tuple[int, ...]  # per draft node 1..k, its parent's index

    def __post_init__(self) -> None:
        """ValueError unless each draft's parent comes before it (the layout the attention mask assumes)."""
        for i, parent in enumerate(self.parents, start=1):
            if not 0 <= parent < i:
                raise ValueError(f"draft {i} of a tree has parent {parent}: a parent must be an earlier node "
                                 "(0: the root)")

    @property
    def num_nodes(self) -> int:
        return len(self.parents) + 1

    def parent(self, node: int) -> int:
        return self.parents[node - 1]

    def depths(self) -> list[int]:
        depths = [0]
        for parent in self.parents:
            depths.append(depths[parent] + 1)
        return depths

    @property
    def depth(self) -> int:
        return max(self.depths())

    def ancestors(self, node: int) -> list[int]:
        """The nodes from the root down to `node`, both included."""
        path = [node]
        while path[-1]:
            path.append(self.parent(path[-1]))
        return path[::-1]

    def hidden_nodes(self, node: int) -> list[int]:
        """The earlier nodes `node` must not see (laid out before it but not its ancestors)."""
        visible = set(self.ancestors(node))
        return [other for other in range(node) if other not in visible]

    def children(self) -> list[list[int]]:
        children: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, parent in enumerate(self.parents, start=1):
            children[parent].append(i)
        return children


def tree_of_paths(paths: Sequence[tuple[int, ...]]) -> SpecTree:
    """The tree whose node i + 1 is `paths[i]` (a path of top-k ranks, one per draft position), each path after
    its prefix: the parent of (0, 1) is (0,), the parent of (2,) the root."""
    index = {path: i for i, path in enumerate(paths, start=1)}
    return SpecTree(tuple(index.get(path[:-1], 0) for path in paths))
