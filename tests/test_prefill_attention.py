"""Paged prefill attention: the native flash-attention kernel and the PyTorch path agree with dense SDPA over the
gathered cache, for fresh prompts and chunks after cached context, GQA groups, sliding windows and every cache dtype;
the AVX2 build of the kernel too."""
import pytest
import torch
import torch.nn.functional as F

from inferno.kernels import paged_attention
from inferno.layers.attention import Attention
from inferno.layers.attention.cpu_kernel_backend import CpuKernelAttentionBackend
from inferno.layers.attention.torch_backend import TorchAttentionBackend
from narrow_builds import narrow_build_run

BLOCK, NUM_BLOCKS = 16, 160
needs_kernel = pytest.mark.skipif(paged_attention() is None, reason="no C++ compiler for the native kernels")


def random_chunk(heads: int, kv_heads: int, head_dim: int, n: int, num_computed: int, dtype: torch.dtype,
                 cache_dtype: torch.dtype | None = None, window: int | None = None):
    """A layer whose cache holds random K/V for positions [0, num_computed + n) in shuffled blocks, and the chunk's
    queries (the last n positions)."""
    torch.manual_seed(n + num_computed)
    attn = Attention(heads, kv_heads, head_dim, sliding_window=window)
    attn.k_cache = torch.randn(kv_heads, NUM_BLOCKS, BLOCK, head_dim).to(cache_dtype or dtype)
    attn.v_cache = torch.randn(kv_heads, NUM_BLOCKS, BLOCK, head_dim).to(cache_dtype or dtype)
    block_ids = torch.randperm(NUM_BLOCKS)[:-(-(num_computed + n) // BLOCK)].tolist()
    return attn, torch.randn(n, heads, head_dim).to(dtype), block_ids


def prefill(backend_class, attn: Attention, q: torch.Tensor, num_computed: int, block_ids: list[int]):
    """The chunk through a backend's own metadata (its K/V are already in the cache)."""
    backend = backend_class(BLOCK, attn.num_kv_heads, NUM_BLOCKS, attn.sliding_window)
    chunk = backend.build_metadata([], [], [(q.shape[0], num_computed, block_ids)]).prefills[0]
    return backend.prefill(attn, q, None, None, chunk)


def dense_reference(attn: Attention, q: torch.Tensor, num_computed: int, block_ids: list[int]) -> torch.Tensor:
    """float32 SDPA over the gathered cache with an explicit causal (and window) mask."""
    total, head_dim = num_computed + q.shape[0], attn.head_dim
    k = attn.k_cache[:, block_ids].reshape(attn.num_kv_heads, -1, head_dim)[:, :total].float()
    v = attn.v_cache[:, block_ids].reshape(attn.num_kv_heads, -1, head_dim)[:, :total].float()
    positions = torch.arange(num_computed, total).unsqueeze(1)
    keys = torch.arange(total).unsqueeze(0)
    mask = keys <= positions
    if attn.sliding_window:
        mask &= keys > positions - attn.sliding_window
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)


CASES = [  # heads, kv heads, head dim, chunk, cached context before it, window
    (9, 3, 64, 100, 0, None),     # SmolLM2's shape, a fresh prompt of several query blocks and key tiles
    (12, 2, 128, 130, 33, None),  # Qwen2.5's, a chunk after context that ends mid-block
    (4, 4, 32, 200, 10, 37),      # no GQA, a window shorter than the chunk
    (8, 1, 16, 5, 300, None),     # multi-query, a short chunk after long context
    (6, 2, 80, 1, 0, None),       # one token; 80: a head that is not a whole number of 4-vector tiles
    (6, 3, 48, 70, 90, 64),       # the window reaches back into the cached context
]


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim, n, num_computed, window", CASES)
@pytest.mark.parametrize("dtype, cache_dtype, tol", [(torch.float32, None, 2e-6), (torch.float32, torch.float16, 2e-6),
                                                     (torch.bfloat16, None, 2e-2), (torch.float16, None, 2e-3)])
def test_kernel_matches_dense(heads, kv_heads, head_dim, n, num_computed, window, dtype, cache_dtype, tol):
    attn, q, block_ids = random_chunk(heads, kv_heads, head_dim, n, num_computed, dtype, cache_dtype, window)
    out = prefill(CpuKernelAttentionBackend, attn, q, num_computed, block_ids)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - dense_reference(attn, q, num_computed, block_ids)).abs().max().item() < tol


@pytest.mark.parametrize("heads, kv_heads, head_dim, n, num_computed, window", CASES[:3])
def test_torch_path_matches_dense(heads, kv_heads, head_dim, n, num_computed, window):
    attn, q, block_ids = random_chunk(heads, kv_heads, head_dim, n, num_computed, torch.float32, window=window)
    # the PyTorch path attends a fresh prompt's own K/V as computed: here, the values the cache holds
    rows = torch.arange(num_computed, num_computed + n)
    k, v = (cache[:, block_ids].reshape(kv_heads, -1, head_dim)[:, rows].transpose(0, 1)
            for cache in (attn.k_cache, attn.v_cache))
    backend = TorchAttentionBackend(BLOCK, kv_heads, NUM_BLOCKS, window)
    chunk = backend.build_metadata([], [], [(n, num_computed, block_ids)]).prefills[0]
    out = backend.prefill(attn, q, k, v, chunk)
    assert (out - dense_reference(attn, q, num_computed, block_ids)).abs().max().item() < 2e-6


@needs_kernel
def test_kernel_rejects_a_table_too_short():
    attn, q, block_ids = random_chunk(4, 2, 32, 40, 0, torch.float32)
    with pytest.raises(RuntimeError, match="block table must cover"):
        torch.ops.inferno.paged_prefill_attention(q, attn.k_cache, attn.v_cache, torch.tensor(block_ids[:2]), 0,
                                                  1.0, 0)


@needs_kernel
def test_avx2_build_matches_dense(tmp_path):
    """The 8-lane path (AVX2 + FMA, as on CPUs without AVX-512), built here with -mno-avx512f."""
    cases = [random_chunk(*case[:5], torch.float32, torch.float16, case[5]) for case in CASES]
    inputs = [(q, attn.k_cache, attn.v_cache, torch.tensor(ids), case[4], attn.scale, case[5] or 0)
              for case, (attn, q, ids) in zip(CASES, cases)]
    code = "outputs = [torch.ops.inferno.paged_prefill_attention(*args) for args in inputs]"
    outputs = narrow_build_run(tmp_path, ["prefill_attention.cpp"], "-mno-avx512f", code, inputs)
    for case, (attn, q, ids), out in zip(CASES, cases, outputs):
        assert (out - dense_reference(attn, q, case[4], ids)).abs().max().item() < 2e-6
