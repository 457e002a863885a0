"""Gives each request the KV blocks its tokens need, and takes them back."""
from inferno.engine.block_pool import BlockPool
from inferno.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False (nothing changed) if blocks ran out."""
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(request.block_ids)
        if needed <= 0:
            return True
        if needed > self.block_pool.num_free_blocks:
            return False
        request.block_ids.extend(self.block_pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        self.block_pool.free(request.block_ids)
        request.block_ids = []
