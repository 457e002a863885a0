"""Which slice of a weight each tensor-parallel rank holds: MLP rows, vocabulary rows, attention heads."""
from dataclasses import dataclass


def even_split(size: int, parts: int, index: int, multiple: int = 1) -> range:
    """Part `index` of `parts` contiguous pieces of range(size), each starting at a multiple of `multiple`, sizes
    differing by at most `multiple` (the last piece may end with a partial one)."""
    units = -(-size // multiple)
    start, stop = units * index // parts * multiple, units * (index + 1) // parts * multiple
    return range(min(start, size), min(stop, size))


@dataclass(frozen=True, slots=True)
class HeadSplit:
    q_heads: range
    kv_heads: range


def split_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadSplit:
    """Attention heads of one rank. Each query head stays with the KV head it reads (heads are independent), so
    KV heads are split as evenly as possible, unevenly when they do not divide (SmolLM2's 3 KV heads on 2 ranks:
    2 and 1). With fewer KV heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks that
    share its query heads."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv = even_split(num_kv_heads, tp_size, tp_rank)
        return HeadSplit(range(kv.start * group, kv.stop * group), kv)
    replicas = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % replicas:
        raise ValueError(f"tensor_parallel_size={tp_size} cannot split {num_heads} query heads over {num_kv_heads} "
                         f"KV heads: with fewer KV heads than ranks, tensor_parallel_size must be a multiple of "
                         f"the KV heads and divide the query heads per KV head ({group})")
    kv_head = tp_rank // replicas
    per_rank = group // replicas
    start = kv_head * group + (tp_rank % replicas) * per_rank
    return HeadSplit(range(start, start + per_rank), range(kv_head, kv_head + 1))
