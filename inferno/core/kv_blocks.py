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


def hash_block(parent: BlockHash | None, token_ids: list[int], lora_int_id: int = 0) -> BlockHash:
    """`lora_int_id`: the LoRA adapter the first block was computed with (its K/V differ from the base model's),
    which every later block inherits through the chain."""
    digest = hashlib.sha256(parent.digest if parent is not None else b"")
    if parent is None and lora_int_id:
        digest.update(b"lora" + lora_int_id.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    return BlockHash(digest.digest(), tuple(token_ids))
