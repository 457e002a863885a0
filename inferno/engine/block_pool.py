"""The pool of KV-cache blocks: reference counts, a least-recently-used free queue, and the prefix cache.

A full block can be registered in the prefix cache under the hash of its tokens and everything before them.
When its last request lets go, the block keeps its K/V and its hash and waits in the free queue (a block freed
earlier is handed out first); a prefix-cache hit takes it back out, and handing it out to new tokens evicts it.
"""
from collections import OrderedDict

from inferno.core.kv_blocks import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evicted on demand)."""
        return len(self.free_block_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    @property
    def usage(self) -> float:
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for new tokens, least recently freed first; a cached block loses its hash."""
        assert n <= len(self.free_block_queue), "caller must check num_free_blocks first"
        blocks = []
        for _ in range(n):
            block, _ = self.free_block_queue.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """One more holder for each block (a prefix-cache hit or a fork); free ones leave the free queue."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.free_block_queue[block]
            self.ref_cnt[block] += 1

    def free(self, blocks: list[int]) -> None:
        """One holder fewer. A sequence's tail goes to the free queue first, so it is evicted before its head."""
        for block in reversed(blocks):
            assert self.ref_cnt[block] > 0, f"block {block} freed twice"
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free_block_queue[block] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached_blocks.get(block_hash)

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Register a computed full block; a second block with the same contents stays unregistered."""
        if self.block_hash[block] is None and block_hash not in self.cached_blocks:
            self.cached_blocks[block_hash] = block
            self.block_hash[block] = block_hash

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (their K/V is left as garbage to overwrite); returns how many there were."""
        n = len(self.cached_blocks)
        self.cached_blocks.clear()
        self.block_hash = [None] * self.num_blocks
        return n

    def _evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.cached_blocks[block_hash]
            self.block_hash[block] = None
