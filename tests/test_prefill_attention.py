"""Paged prefill attention: the native flash-attention kernel and the PyTorch path agree with dense SDPA over the
cached context and the chunk's own K/V, for fresh prompts and chunks after cached context, GQA groups, sliding
windows and every cache dtype; the AVX2 build of the kernel too; the kernel's one call over many packed chunks
(a step of many prompts) gives each chunk what it gives it alone."""
import pytest
import torch
import torch.nn.functional as F

from inferno.layers.attention import Attention
from inferno.layers.attention.cpu_kernel_backend import CpuKernelAttentionBackend
from inferno.layers.attention.torch_backend import TorchAttentionBackend
from native_kernels import EACH_ISA_LEVEL, isa_level_run, needs_kernels

BLOCK, NUM_BLOCKS = 16, 160


def random_chunk(heads: int, kv_heads: int, head_dim: int, n: int, num_computed: int, dtype: torch.dtype,
                 cache_dtype: torch.dtype | None = None, window: int | None = None, written: bool = True):
    """A layer whose cache holds random K/V for positions [0, num_computed + n) in shuffled blocks, the chunk's
    queries and its own K/V as computed (the last n positions; the cache holds them rounded to its dtype, or random
    values where `written` is False: an embedding's chunk, whose K/V no later step reads, is not written)."""
    torch.manual_seed(n + num_computed)
    attn = Attention(heads, kv_heads, head_dim, sliding_window=window)
    attn.k_cache = torch.randn(kv_heads, NUM_BLOCKS, BLOCK, head_dim).to(cache_dtype or dtype)
    attn.v_cache = torch.randn(kv_heads, NUM_BLOCKS, BLOCK, head_dim).to(cache_dtype or dtype)
    block_ids = torch.randperm(NUM_BLOCKS)[:-(-(num_computed + n) // BLOCK)].tolist()
    k, v = torch.randn(n, kv_heads, head_dim).to(dtype), torch.randn(n, kv_heads, head_dim).to(dtype)
    slots = torch.tensor([block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(num_computed, num_computed + n)])
    if written:
        TorchAttentionBackend.write(attn, k, v, slots)
    return attn, torch.randn(n, heads, head_dim).to(dtype), k, v, block_ids


def prefill(backend_class, attn: Attention, q, k, v, num_computed: int, block_ids: list[int]):
    """The chunk through a backend's own metadata (its K/V are already in the cache)."""
    backend = backend_class(BLOCK, attn.num_kv_heads, NUM_BLOCKS, attn.sliding_window)
    chunk = backend.build_metadata([], [], [(q.shape[0], num_computed, block_ids)]).prefills[0]
    return backend.prefill(attn, q, k, v, chunk)


def dense_reference(attn: Attention, q, k, v, num_computed: int, block_ids: list[int]) -> torch.Tensor:
    """float32 SDPA with an explicit causal (and window) mask over the cached context and the chunk's own K/V."""
    total, head_dim = num_computed + q.shape[0], attn.head_dim
    context_k, context_v = (cache[:, block_ids].reshape(attn.num_kv_heads, -1, head_dim)[:, :num_computed].float()
                            for cache in (attn.k_cache, attn.v_cache))
    keys = torch.cat([context_k, k.float().transpose(0, 1)], dim=1)
    values = torch.cat([context_v, v.float().transpose(0, 1)], dim=1)
    positions = torch.arange(num_computed, total).unsqueeze(1)
    key_positions = torch.arange(total).unsqueeze(0)
    mask = key_positions <= positions
    if attn.sliding_window:
        mask &= key_positions > positions - attn.sliding_window
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)


CASES = [  # heads, kv heads, head dim, chunk, cached context before it, window
    (9, 3, 64, 100, 0, None),     # SmolLM2's shape, a fresh prompt of several query blocks and key tiles
    (12, 2, 128, 130, 33, None),  # Qwen2.5's, a chunk after context that ends mid-block
    (4, 4, 32, 200, 10, 37),      # no GQA, a window shorter than the chunk
    (8, 1, 16, 5, 300, None),     # multi-query, a short chunk after long context
    (6, 2, 80, 1, 0, None),       # one token; 80: a head that is not a whole number of 4-vector tiles
    (6, 3, 48, 70, 90, 64),       # the window reaches back into the cached context
]


@needs_kernels
@pytest.mark.parametrize("heads, kv_heads, head_dim, n, num_computed, window", CASES)
@pytest.mark.parametrize("dtype, cache_dtype, tol", [(torch.float32, None, 2e-6), (torch.float32, torch.float16, 2e-6),
                                                     (torch.bfloat16, None, 2e-2), (torch.float16, None, 2e-3)])
@pytest.mark.parametrize("written", [True, False], ids=["kv-written", "kv-unwritten"])
def test_kernel_matches_dense(heads, kv_heads, head_dim, n, num_computed, window, dtype, cache_dtype, tol, written):
    """float32 over a float16 cache: the chunk's own K/V as cached too, as the context (so a prompt computes the same
    however it is chunked). The chunk's own K/V are read from k, v: the cache need not hold them."""
    attn, q, k, v, block_ids = random_chunk(heads, kv_heads, head_dim, n, num_computed, dtype, cache_dtype, window,
                                            written)
    # v a view of a fused QKV buffer as the decoder passes it; k a tensor of its own (as after Qwen3's k norm)
    qkv = torch.cat([q, k, v], dim=1)
    q, _, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    out = prefill(CpuKernelAttentionBackend, attn, q, k, v, num_computed, block_ids)
    assert out.dtype == dtype and out.shape == q.shape
    k, v = k.to(attn.k_cache.dtype), v.to(attn.v_cache.dtype)
    assert (out.float() - dense_reference(attn, q, k, v, num_computed, block_ids)).abs().max().item() < tol


@pytest.mark.parametrize("heads, kv_heads, head_dim, n, num_computed, window", CASES[:3])
def test_torch_path_matches_dense(heads, kv_heads, head_dim, n, num_computed, window):
    attn, q, k, v, block_ids = random_chunk(heads, kv_heads, head_dim, n, num_computed, torch.float32, window=window)
    out = prefill(TorchAttentionBackend, attn, q, k, v, num_computed, block_ids)
    assert (out - dense_reference(attn, q, k, v, num_computed, block_ids)).abs().max().item() < 2e-6


def kernel_inputs(attn: Attention, q, k, v, num_computed: int, block_ids: list[int]) -> tuple:
    """`torch.ops.inferno.paged_prefill_attention`'s arguments for one chunk."""
    return (q, k, v, attn.k_cache, attn.v_cache, torch.tensor([block_ids]), torch.tensor([0, q.shape[0]]),
            torch.tensor([num_computed + q.shape[0]]), attn.scale, attn.sliding_window or 0)


@needs_kernels
def test_kernel_rejects_a_table_too_short():
    attn, q, k, v, block_ids = random_chunk(4, 2, 32, 40, 0, torch.float32)
    with pytest.raises(RuntimeError, match="block table must cover"):
        torch.ops.inferno.paged_prefill_attention(*kernel_inputs(attn, q, k, v, 0, block_ids[:2]))


@needs_kernels
@pytest.mark.parametrize("window", [None, 24])
def test_packed_chunks_match_each_alone(window):
    """Chunks of several prompts packed in one call (fresh ones of 1..130 tokens, one after cached context), through
    the backend's metadata: each chunk's rows are what the dense reference gives it alone."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 9, 3, 64
    shapes = [(37, 0), (1, 0), (130, 0), (20, 45), (64, 0)]  # (chunk, cached context before it)
    attn = Attention(heads, kv_heads, head_dim, sliding_window=window)
    attn.k_cache = torch.randn(kv_heads, NUM_BLOCKS, BLOCK, head_dim).to(torch.float16)
    attn.v_cache = torch.randn(kv_heads, NUM_BLOCKS, BLOCK, head_dim).to(torch.float16)
    free = torch.randperm(NUM_BLOCKS).tolist()
    chunks = []
    for n, num_computed in shapes:
        block_ids = [free.pop() for _ in range(-(-(num_computed + n) // BLOCK))]
        q = torch.randn(n, heads, head_dim)
        k, v = torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)
        slots = torch.tensor([block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(num_computed, num_computed + n)])
        TorchAttentionBackend.write(attn, k, v, slots)
        chunks.append((q, k, v, num_computed, block_ids))
    backend = CpuKernelAttentionBackend(BLOCK, kv_heads, NUM_BLOCKS, window)
    meta = backend.build_metadata([], [], [(q.shape[0], c, ids) for q, _, _, c, ids in chunks])
    assert len(meta.prefills) == 1  # one call for every chunk
    packed = [torch.cat([chunk[i] for chunk in chunks]) for i in range(3)]
    out = backend.prefill(attn, *packed, meta.prefills[0])
    for (q, k, v, num_computed, block_ids), rows in zip(chunks, out.split([n for n, _ in shapes])):
        reference = dense_reference(attn, q, k.half(), v.half(), num_computed, block_ids)  # own K/V as cached
        assert (rows - reference).abs().max().item() < 2e-6
        alone = backend.build_metadata([], [], [(q.shape[0], num_computed, block_ids)]).prefills[0]
        assert torch.equal(rows, backend.prefill(attn, q, k, v, alone))  # batch invariance: the same bits


@needs_kernels
@pytest.mark.parametrize("cache_dtype, window", [(torch.float32, None), (torch.float16, None), (torch.float16, 50)])
def test_a_prompt_chunked_computes_the_same_bits_as_whole(cache_dtype, window):
    """A prompt's attention does not depend on how a step's token budget chunks it (which depends on the batch):
    every chunk reads its own K/V as the cache holds them, as the next chunks read them."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, n = 9, 3, 64, 150
    attn = Attention(heads, kv_heads, head_dim, sliding_window=window)
    attn.k_cache = torch.zeros(kv_heads, NUM_BLOCKS, BLOCK, head_dim, dtype=cache_dtype)
    attn.v_cache = torch.zeros(kv_heads, NUM_BLOCKS, BLOCK, head_dim, dtype=cache_dtype)
    block_ids = torch.randperm(NUM_BLOCKS)[:-(-n // BLOCK)].tolist()
    q, k, v = torch.randn(n, heads, head_dim), torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)
    TorchAttentionBackend.write(attn, k, v, torch.tensor([block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]))
    whole = prefill(CpuKernelAttentionBackend, attn, q, k, v, 0, block_ids)
    bounds = [0, 37, 38, 100, n]  # chunks ending mid-block, of one token, of several key tiles
    chunked = torch.cat([prefill(CpuKernelAttentionBackend, attn, q[a:b], k[a:b], v[a:b], a, block_ids)
                         for a, b in zip(bounds, bounds[1:])])
    assert torch.equal(chunked, whole)


@needs_kernels
@EACH_ISA_LEVEL
def test_each_isa_level_matches_dense(tmp_path, level):
    """The 16-lane paths (AVX-512, vdpbf16ps for bfloat16), the 8-lane ones (AVX2 + FMA) and the plain loops."""
    chunks = [random_chunk(*case[:5], torch.float32, torch.float16, case[5]) for case in CASES]
    inputs = [kernel_inputs(attn, q, k, v, case[4], ids) for case, (attn, q, k, v, ids) in zip(CASES, chunks)]
    code = "outputs = [torch.ops.inferno.paged_prefill_attention(*args) for args in inputs]"
    outputs = isa_level_run(tmp_path, level, code, inputs)
    for case, (attn, q, k, v, ids), out in zip(CASES, chunks, outputs):
        assert (out - dense_reference(attn, q, k, v, case[4], ids)).abs().max().item() < 2e-6
