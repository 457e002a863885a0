"""Paged attention in Triton (the GPU backend's kernels; on a CPU they run under Triton's interpreter in tests).

The cache of one layer is head-major, `[kv_heads, num_blocks, block_size, head_dim]` (contiguous in head_dim), and
a request's keys are read through its block table: key position `p` lives in block `table[p // block_size]` at
slot `p % block_size`. All three kernels compute in float32 whatever the cache dtype.

- `write_kv`: new K/V rows into their slots (`slot_mapping`; negative slots — padding — are skipped).
- `paged_decode_attention`: one query row per sequence; one program per (sequence, KV head, context partition)
  computes every query head of its group at once (grouped-query attention natively, one K/V read per group), with
  FlashAttention's online softmax over key tiles; a second kernel merges the partitions (flash-decoding), so a
  long context spreads over many programs.
- `paged_prefill_attention`: variable-length query chunks (packed one after another) attending causally to their
  own keys and to everything already cached before them (chunked prefill, prefix-cache hits): one program per
  (chunk, query head, tile of query rows).
Sliding windows (keys within `window` positions: q - window < k <= q) and tanh soft-capping of scores are
handled in the kernels.
"""
import os

import torch
import triton
import triton.language as tl

# tiles: the fastest of benchmarks/gpu_check.py's sweep on an H200 (bfloat16, head size 64; RESULTS.md)
PARTITION_SIZE = 512  # keys per decode program (flash-decoding split)
DECODE_KEY_TILE = 128  # keys per inner iteration of a decode program
QUERY_TILE = 64  # prefill query rows per program
PREFILL_KEY_TILE = 32  # keys per inner iteration of a prefill program
MIN_DOT = 16  # tl.dot's smallest tile side on GPUs


def f32_dot(dtype: torch.dtype) -> bool:
    """Whether products run on float32 operands (IEEE, not TF32): float32 caches, and bfloat16 under the
    interpreter, whose tl.dot mistakes bfloat16 for integers."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


def _pow2(n: int, least: int = MIN_DOT) -> int:
    return max(triton.next_power_of_2(n), least)


@triton.jit
def _softcap(s, cap):
    # cap * tanh(s / cap), tanh(x) = 2 sigmoid(2x) - 1
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


@triton.jit
def _scores(q, k, scale, softcap, SOFTCAP: tl.constexpr, F32_DOT: tl.constexpr):
    """q [M, D] . k [N, D] -> scaled (and soft-capped) scores [M, N] in float32."""
    if F32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    if SOFTCAP:
        s = _softcap(s, softcap)
    return s


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, F32_DOT: tl.constexpr):
    """FlashAttention's update of (running max, running sum, output) by one tile of masked scores s [M, N] and
    values v [N, D]; rows that see no key yet keep max -inf and add nothing."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    if F32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slots, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ch, stride_cb, stride_cs, block_size, head_dim, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        dm = d < head_dim
        dest = h * stride_ch + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dm)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dm)
        tl.store(k_cache + dest, k.to(k_cache.dtype.element_ty), mask=dm)
        tl.store(v_cache + dest, v.to(v_cache.dtype.element_ty), mask=dm)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [T, kv_heads, head_dim] (last dim contiguous) into the caches at `slot_mapping` [T]."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _write_kv_kernel[(tokens, kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[2], head_dim,
        BLOCK_D=_pow2(head_dim, 1))


@triton.jit
def _decode_partition_kernel(
        q_ptr, k_cache, v_cache, block_tables, seq_lens, part_out, part_max, part_sum, scale, softcap, window,
        stride_qt, stride_qh, stride_bt, stride_ch, stride_cb, stride_cs, stride_pt, stride_ph, stride_ps,
        stride_mt, stride_mh, group, head_dim, block_size, partition_size,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
        F32_DOT: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    first = split * partition_size
    lo = first
    if window > 0:
        lo = tl.maximum(lo, seq_len - window)
    hi = tl.minimum(first + partition_size, seq_len)
    g = tl.arange(0, BLOCK_G)
    heads = kv_head * group + g
    d = tl.arange(0, BLOCK_D)
    qm = (g < group)[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qm, other=0.0)
    q = q.to(k_cache.dtype.element_ty)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    for start in range(lo - lo % BLOCK_N, hi, BLOCK_N):  # every tile holds at least one key of [lo, hi)
        pos = start + tl.arange(0, BLOCK_N)
        pm = (pos >= lo) & (pos < hi)
        block = tl.load(block_tables + b * stride_bt + pos // block_size, mask=pm, other=0)
        rows = kv_head * stride_ch + block.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs
        km = pm[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_cache + rows[:, None] + d[None, :], mask=km, other=0.0)
        v = tl.load(v_cache + rows[:, None] + d[None, :], mask=km, other=0.0)
        s = tl.where(pm[None, :], _scores(q, k, scale, softcap, SOFTCAP, F32_DOT), float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, F32_DOT)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(part_out + b * stride_pt + heads[:, None] * stride_ph + split * stride_ps + d[None, :], out, mask=qm)
    gm = g < group
    tl.store(part_max + b * stride_mt + heads * stride_mh + split, m_i, mask=gm)
    tl.store(part_sum + b * stride_mt + heads * stride_mh + split, l_i, mask=gm)


@triton.jit
def _decode_merge_kernel(part_out, part_max, part_sum, out_ptr, num_splits, stride_pt, stride_ph, stride_ps,
                         stride_mt, stride_mh, stride_ot, stride_oh, head_dim,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sm = s < num_splits
    m = tl.load(part_max + b * stride_mt + h * stride_mh + s, mask=sm, other=float("-inf"))
    l = tl.load(part_sum + b * stride_mt + h * stride_mh + s, mask=sm, other=0.0)
    has_keys = sm & (l > 0)
    m_max = tl.max(tl.where(has_keys, m, float("-inf")), 0)
    w = tl.where(has_keys, tl.exp(m - m_max) * l, 0.0)
    om = has_keys[:, None] & (d < head_dim)[None, :]
    o = tl.load(part_out + b * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :], mask=om, other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int = 0,
                           softcap: float | None = None) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, at position seq_len - 1), block_tables [B, width] int32, seq_lens [B]
    int32 (each >= 1) -> [B, H, D]. The number of partitions follows the tables' width (no host synchronisation)."""
    batch, num_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    num_splits = triton.cdiv(block_tables.shape[1] * block_size, PARTITION_SIZE)
    part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    block_d = _pow2(head_dim)
    _decode_partition_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_max, part_sum, scale, softcap or 0.0, window,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_max.stride(0), part_max.stride(1),
        group, head_dim, block_size, PARTITION_SIZE,
        BLOCK_G=_pow2(group), BLOCK_N=DECODE_KEY_TILE, BLOCK_D=block_d, SOFTCAP=softcap is not None,
        F32_DOT=f32_dot(k_cache.dtype))
    _decode_merge_kernel[(batch, num_heads)](
        part_out, part_max, part_sum, out, num_splits, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_max.stride(0), part_max.stride(1), out.stride(0), out.stride(1), head_dim,
        BLOCK_S=_pow2(num_splits, 1), BLOCK_D=block_d)
    return out


@triton.jit
def _prefill_kernel(
        q_ptr, k_cache, v_cache, block_tables, query_start, seq_lens, out_ptr, scale, softcap, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_ch, stride_cb, stride_cs,
        group, head_dim, block_size,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
        F32_DOT: tl.constexpr):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start + chunk)
    q_len = tl.load(query_start + chunk + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens + chunk)
        context = seq_len - q_len  # keys cached before the chunk: the first query sits at this position
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rm = rows < q_len
        q_pos = context + rows
        d = tl.arange(0, BLOCK_D)
        dm = d < head_dim
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=rm[:, None] & dm[None, :], other=0.0).to(k_cache.dtype.element_ty)
        kv_head = head // group
        hi = tl.minimum(seq_len, context + (tile + 1) * BLOCK_M)  # the tile's last query sees keys up to itself
        lo = 0
        if window > 0:
            lo = tl.maximum(context + tile * BLOCK_M - window + 1, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        for start in range(lo - lo % BLOCK_N, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pm = pos < hi
            block = tl.load(block_tables + chunk * stride_bt + pos // block_size, mask=pm, other=0)
            offsets = kv_head * stride_ch + block.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs
            km = pm[:, None] & dm[None, :]
            k = tl.load(k_cache + offsets[:, None] + d[None, :], mask=km, other=0.0)
            v = tl.load(v_cache + offsets[:, None] + d[None, :], mask=km, other=0.0)
            visible = (pos[None, :] <= q_pos[:, None]) & pm[None, :]
            if window > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, _scores(q, k, scale, softcap, SOFTCAP, F32_DOT), float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, F32_DOT)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                            max_query_len: int, scale: float, window: int = 0, softcap: float | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D]: chunk i's queries are rows query_start[i]:query_start[i + 1] at the last positions of its
    seq_lens[i] keys (all of them already written to the cache); block_tables [chunks, width] int32 -> [T, H, D]."""
    tokens, num_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    chunks = block_tables.shape[0]
    if chunks == 0:
        return out
    _prefill_kernel[(chunks, num_heads, triton.cdiv(max_query_len, QUERY_TILE))](
        q, k_cache, v_cache, block_tables, query_start, seq_lens, out, scale, softcap or 0.0, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_heads // kv_heads, head_dim, block_size,
        BLOCK_M=QUERY_TILE, BLOCK_N=PREFILL_KEY_TILE, BLOCK_D=_pow2(head_dim), SOFTCAP=softcap is not None,
        F32_DOT=f32_dot(k_cache.dtype))
    return out
