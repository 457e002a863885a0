"""Gives each request the KV blocks its tokens need, reuses cached prefixes, forks block tables, takes blocks back.

Block tables can share blocks: prefix-cache hits share full blocks between requests with the same prefix, and
forks (the samples of an n > 1 request, beams) share their parent's blocks. A shared block is never written:
before a request writes into a partial block someone else holds, it gets a private copy (copy-on-write).

With a sliding window on every layer, the leading blocks no later query can see are freed as a request advances
(`num_dropped_blocks`), so a long sequence holds about a window of blocks. The prefix cache stays exact: a block is
dropped only once it is registered there, and a hit is a run of cached blocks from the start, with all their K/V.
"""
import logging

from inferno.core.kv_blocks import BlockHash, cdiv, hash_block
from inferno.engine.block_pool import BlockPool
from inferno.request import Request

logger = logging.getLogger("inferno")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # of every layer; None: all blocks are kept
        self.block_pool = BlockPool(num_blocks)
        self.block_copies: list[tuple[int, int]] = []  # (source, destination) to copy before the next forward
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> list[int] | None:
        """The longest run of cached full blocks at the start of a request that has no blocks yet; None when the
        request does not use the prefix cache. The last token is always left to compute: it yields the logits (or an
        embedding). Prompt logprobs and embeddings pooled over more than the last token (MEAN, CLS) read the hidden
        states of positions a hit would skip: those requests compute their whole prompt."""
        if (not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None
                or not self._pooling_uses_prefix_cache(request)):
            return None
        assert not request.block_ids
        blocks = []
        for block_hash in self._block_hashes(request, (request.num_tokens - 1) // self.block_size):
            block = self.block_pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`, after the prefix-cache hit `computed_blocks`
        of a request being admitted; False (nothing changed) if blocks ran out."""
        self._drop_blocks_outside_window(request)
        hits = computed_blocks or []
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        needed = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - len(request.block_ids) - len(hits))
        shared = self._shared_partial_block(request) if num_new_tokens > 0 else None
        copy = shared is not None
        reclaimed = sum(1 for b in hits if self.block_pool.ref_cnt[b] == 0)  # cached blocks sitting in the free queue
        if needed + copy > self.block_pool.num_free_blocks - reclaimed:
            return False
        if computed_blocks is not None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(hits) * self.block_size
            self.block_pool.touch(hits)
            request.block_ids = list(hits)
            request.num_cached_blocks = len(hits)
            request.num_computed_tokens = num_computed
        if copy:
            self._copy_on_write(request, shared)
        if needed:
            request.block_ids.extend(self.block_pool.allocate(needed))
        self._drop_blocks_outside_window(request)
        return True

    def cache_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks in the prefix cache. An embedding request that does not
        look the cache up leaves nothing there either: the worker writes no K/V for a prompt it computes whole."""
        if not self.enable_prefix_caching or not self._pooling_uses_prefix_cache(request):
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_cached_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(request.num_cached_blocks, num_full):
            self.block_pool.cache(request.block_ids[i], hashes[i])
        request.num_cached_blocks = num_full

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Give `child` the parent's K/V for its first `num_tokens` tokens by sharing the blocks holding them."""
        shared = parent.block_ids[:cdiv(num_tokens, self.block_size)]
        child.num_dropped_blocks = min(parent.num_dropped_blocks, len(shared))
        self.block_pool.touch(shared[child.num_dropped_blocks:])
        child.block_ids = list(shared)
        num_full = num_tokens // self.block_size
        child.block_hashes = parent.block_hashes[:num_full]
        child.num_cached_blocks = min(parent.num_cached_blocks, num_full)
        child.num_computed_tokens = num_tokens

    def free(self, request: Request) -> None:
        self.block_pool.free(request.block_ids[request.num_dropped_blocks:])
        request.block_ids = []
        request.num_cached_blocks = 0
        request.num_dropped_blocks = 0

    def take_blocks(self, request: Request, num_blocks: int) -> list[int]:
        """Detach the first `num_blocks` blocks from a finished request, still held (for a KV transfer; give them
        back with `free_blocks`); its other blocks are freed."""
        assert request.num_dropped_blocks == 0, "a KV transfer needs every block (no sliding-window dropping)"
        taken, rest = request.block_ids[:num_blocks], request.block_ids[num_blocks:]
        self.block_pool.free(rest)
        request.block_ids = []
        request.num_cached_blocks = 0
        return taken

    def free_blocks(self, block_ids: list[int]) -> None:
        self.block_pool.free(block_ids)

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self.block_copies = self.block_copies, []
        return copies

    def reset_prefix_cache(self) -> int:
        return self.block_pool.reset_prefix_cache()

    @staticmethod
    def _pooling_uses_prefix_cache(request: Request) -> bool:
        return request.pooling_params is None or request.pooling_params.uses_prefix_cache

    def _drop_blocks_outside_window(self, request: Request) -> None:
        """Free the leading blocks that every later query's window has passed: the next query is at position
        num_computed_tokens, and a query at q sees keys k > q - window."""
        if self.sliding_window is None:
            return
        num_outside = max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        if self.enable_prefix_caching and self._pooling_uses_prefix_cache(request):
            num_outside = min(num_outside, request.num_cached_blocks)
        num_outside = min(num_outside, len(request.block_ids))
        if num_outside > request.num_dropped_blocks:
            self.block_pool.free(request.block_ids[request.num_dropped_blocks:num_outside])
            request.num_dropped_blocks = num_outside

    def _shared_partial_block(self, request: Request) -> int | None:
        """Index in the block table of the block the next token is written to, if another request holds it too."""
        index = request.num_computed_tokens // self.block_size
        if index < len(request.block_ids) and self.block_pool.ref_cnt[request.block_ids[index]] > 1:
            return index
        return None

    def _copy_on_write(self, request: Request, index: int) -> None:
        source = request.block_ids[index]
        (copy,) = self.block_pool.allocate(1)
        self.block_pool.free([source])
        request.block_ids[index] = copy
        self.block_copies.append((source, copy))

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's first `num_blocks` full-block hashes, computed once and kept on the request."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, request.token_ids[i * bs:(i + 1) * bs],
                                     request.lora_int_id))
        return hashes[:num_blocks]


def log_kv_cache(num_blocks: int, block_size: int, block_bytes: int, max_model_len: int, auto: bool) -> None:
    """What fits, the way vLLM and llama.cpp users are used to reading it."""
    tokens = num_blocks * block_size
    how = " (kv_cache_memory: auto, half the memory available after loading the weights)" if auto else ""
    logger.info("KV cache: %d blocks = %d tokens, %.2f GiB; %.1f sequences of max_model_len %d%s", num_blocks,
                tokens, num_blocks * block_bytes / (1 << 30), tokens / max_model_len, max_model_len, how)
