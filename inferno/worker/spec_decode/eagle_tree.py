"""A static token tree as an EAGLE head drafts it, depth by depth, on its own paged KV cache.

The head's pass for position p reads the token at p + 1, so its root is the pass at the position before the
request's last token (slot r = n - 2 for n tokens: the catch-up's last), whose output ranks the tree's first
tokens. A node with children gets a pass of its own, over its token at position r + its depth, whose output ranks
its children. Those passes take the slots after the root's, one each in layout order (`passes`), so a tree needs as
many slots past the root as it has inner nodes, not one per node; each pass attends to the context and to its
ancestors' passes, the slots of earlier non-ancestors hidden. Nothing of them outlives the proposal: the next one
rewrites every slot past the request's last token from the target's features (ProposerCache)."""
from collections.abc import Sequence
from dataclasses import dataclass

from inferno.core.spec_tree import SpecTree, tree_of_paths


@dataclass(frozen=True, slots=True)
class HeadTree:
    paths: tuple[tuple[int, ...], ...]  # nodes 1.. in layout order, each its path of ranks
    tree: SpecTree
    passes: tuple[int, ...]  # the nodes with children, in layout order: pass j writes slot root + 1 + j

    @classmethod
    def cut(cls, token_tree: Sequence[tuple[int, ...]], depth: int, num_slots: int) -> "HeadTree":
        """`token_tree` (paths sorted by length, then rank) up to `depth`, its inner nodes' passes in the first
        `num_slots` slots after the root's (nodes under the others dropped)."""
        paths = [path for path in token_tree if len(path) <= depth]
        inner = {path[:-1] for path in paths}
        kept = {path for path in paths if path in inner}
        kept = set(sorted(kept, key=lambda path: (len(path), path))[:num_slots]) | {()}
        paths = tuple(path for path in paths if path[:-1] in kept)
        tree = tree_of_paths(paths)
        children = tree.children()
        return cls(paths, tree, tuple(node for node in range(1, tree.num_nodes) if children[node]))

    def rank(self, node: int) -> int:
        """Which of its parent's top tokens `node` is."""
        return self.paths[node - 1][-1]

    def pass_slot(self, node: int, root: int) -> int:
        return root + 1 + self.passes.index(node)

    def hidden_slots(self, node: int, root: int) -> list[int]:
        """The slots of earlier passes that `node`'s pass must not see (other branches)."""
        hidden = set(self.tree.hidden_nodes(node))
        return [self.pass_slot(other, root) for other in self.passes if other in hidden]
