"""The pool of KV-cache blocks: a free list and reference counts."""
from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free_block_queue: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_block_queue), "caller must check num_free_blocks first"
        blocks = [self.free_block_queue.popleft() for _ in range(n)]
        for b in blocks:
            assert self.ref_cnt[b] == 0
            self.ref_cnt[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            assert self.ref_cnt[b] > 0, f"block {b} freed twice"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_block_queue.append(b)

    @property
    def usage(self) -> float:
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks
