"""KV-cache blocks as every layer sees them: how many a token count needs, and a full block's prefix identity."""
import hashlib
from array import array
from typing import NamedTuple


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: the blocks of size b that a tokens need."""
    return -(-a // b)


class BlockHash(NamedTuple):
    """Identity of a full block: the SHA-256 of the whole token prefix up to and including the block (chained
    through the parent block's digest), plus the block's own token ids, compared exactly. Serving a wrong block
    would take a SHA-256 collision."""
    digest: bytes
    token_ids: tuple[int, ...]


def hash_block(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    digest = hashlib.sha256(parent.digest if parent is not None else b"")
    digest.update(array("q", token_ids).tobytes())
    return BlockHash(digest.digest(), tuple(token_ids))
