"""Paged decode attention: the native kernel and the PyTorch gather path agree with dense SDPA."""
import pytest
import torch
import torch.nn.functional as F

from inferno.layers.attention import Attention
from inferno.layers.attention.cpu_kernel_backend import CpuKernelAttentionBackend
from inferno.layers.attention.torch_backend import TorchAttentionBackend
from native_kernels import EACH_ISA_LEVEL, isa_level_run, needs_kernels, require_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 9, 3, 64, 16, 200


def random_batch(dtype: torch.dtype, seq_lens: list[int], head_dim: int = HEAD_DIM):
    torch.manual_seed(0)
    attn = Attention(HEADS, KV_HEADS, head_dim)
    attn.k_cache = torch.randn(KV_HEADS, NUM_BLOCKS, BLOCK, head_dim, dtype=dtype)
    attn.v_cache = torch.randn(KV_HEADS, NUM_BLOCKS, BLOCK, head_dim, dtype=dtype)
    width = max(-(-n // BLOCK) for n in seq_lens)
    tables = torch.stack([torch.randperm(NUM_BLOCKS)[:width] for _ in seq_lens])
    q = torch.randn(len(seq_lens), HEADS, head_dim, dtype=dtype)
    return attn, q, tables, torch.tensor(seq_lens)


def decode(path: str, attn: Attention, q, tables, seq_lens) -> torch.Tensor:
    """The decode rows through one backend's own metadata."""
    if path == "kernel":
        require_kernels()
    backend = (CpuKernelAttentionBackend if path == "kernel" else TorchAttentionBackend)(
        BLOCK, KV_HEADS, NUM_BLOCKS, attn.sliding_window)
    group = backend.decode_metadata(torch.zeros(0, dtype=torch.long), tables, seq_lens).decode_groups[0]
    return backend.decode(attn, q, group)


def dense_reference(attn: Attention, q, tables, seq_lens) -> torch.Tensor:
    out = []
    head_dim = attn.k_cache.shape[-1]
    for b, n in enumerate(seq_lens.tolist()):
        k = attn.k_cache[:, tables[b]].reshape(KV_HEADS, -1, head_dim)[:, :n].float()
        v = attn.v_cache[:, tables[b]].reshape(KV_HEADS, -1, head_dim)[:, :n].float()
        out.append(F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, enable_gqa=True).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("path", ["kernel", "gather"])
# one long sequence and a short one beside a long one: the kernel splits them over threads (flash-decoding)
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 100, 333], [1000], [3, 700]])
def test_decode_attention_matches_dense(path, dtype, tol, lens):
    attn, q, tables, seq_lens = random_batch(dtype, lens)
    out = decode(path, attn, q, tables, seq_lens)
    assert out.dtype == dtype
    assert (out.float() - dense_reference(attn, q, tables, seq_lens)).abs().max().item() < tol


@pytest.mark.parametrize("path", ["kernel", "gather"])
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 100, 333], [3, 700]])
def test_float32_queries_over_a_float16_cache(path, lens):
    """The default cache of a float32 model on the CPU: K/V stored in float16, attention computed in float32 (the
    kernel converts each row as it loads it, the gather path after gathering); the same as dense float32
    attention over the float16 values."""
    attn, _, tables, seq_lens = random_batch(torch.float16, lens)
    q = torch.randn(len(lens), HEADS, HEAD_DIM)
    out = decode(path, attn, q, tables, seq_lens)
    assert out.dtype == torch.float32
    assert (out - dense_reference(attn, q, tables, seq_lens)).abs().max().item() < 1e-5


@needs_kernels
@pytest.mark.parametrize("threads", [2, 8])
def test_a_sequence_decodes_the_same_bits_alone_or_batched(threads):
    """How the kernel splits a sequence's keys over threads depends on its own length only: alone (split to keep every
    thread busy) and beside others (when the batch alone would keep them busy) it gives the same bits."""
    attn, q, tables, seq_lens = random_batch(torch.float16, [5, 700, 300, 17, 2000])
    q = q.float()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = decode("kernel", attn, q, tables, seq_lens)
        for b in range(len(seq_lens)):
            alone = decode("kernel", attn, q[b:b + 1], tables[b:b + 1], seq_lens[b:b + 1])
            assert torch.equal(alone[0], batched[b]), f"sequence {b} of {seq_lens[b]} tokens"
    finally:
        torch.set_num_threads(previous)


@needs_kernels
def test_a_sequence_decodes_the_same_bits_on_fewer_threads_than_it_is_split_for():
    """The splits follow the threads named (the engine's), not those the call runs on (the serving thread runs on one
    fewer while the decode step compiles): the same bits on 1, 2 or 4 threads; split for one thread, other bits."""
    require_kernels()
    attn, q, tables, seq_lens = random_batch(torch.float16, [5, 700, 2000])
    args = (q.float(), attn.k_cache, attn.v_cache, tables, seq_lens, HEAD_DIM ** -0.5, 0)
    previous, outputs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            outputs.append(torch.ops.inferno.paged_decode_attention(*args, 4))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])
    assert not torch.equal(outputs[0], torch.ops.inferno.paged_decode_attention(*args, 1))
    assert (outputs[0] - dense_reference(attn, q.float(), tables, seq_lens)).abs().max().item() < 1e-5


@needs_kernels
@EACH_ISA_LEVEL
def test_each_isa_level_of_the_decode_kernel_matches_dense(tmp_path, level):
    """The 16-lane path (AVX-512), the 8-lane one (AVX2 + FMA + F16C) and the plain loops: float32 queries over
    float16 caches, and bfloat16, with a long sequence split over the threads."""
    batches = [random_batch(torch.float16, [1, 17, 300]), random_batch(torch.bfloat16, [3, 700])]
    inputs = [(q.float() if attn.k_cache.dtype == torch.float16 else q, attn.k_cache, attn.v_cache, tables, lens,
               HEAD_DIM ** -0.5) for attn, q, tables, lens in batches]
    code = "outputs = [torch.ops.inferno.paged_decode_attention(*args) for args in inputs]"
    outputs = isa_level_run(tmp_path, level, code, inputs)
    for (attn, _, tables, lens), (q, *_), out, tol in zip(batches, inputs, outputs, (1e-5, 3e-2)):
        assert (out.float() - dense_reference(attn, q, tables, lens)).abs().max().item() < tol


# tiles of whole register rows (4 x 8 floats with AVX2, 8 x 16 with AVX-512), then single vectors for the rest
@pytest.mark.parametrize("head_dim", [256, 128, 96, 80, 32, 16])
def test_decode_kernel_head_dims(head_dim):
    attn, q, tables, seq_lens = random_batch(torch.float32, [1, 17, 300], head_dim)
    out = decode("kernel", attn, q, tables, seq_lens)
    assert (out - dense_reference(attn, q, tables, seq_lens)).abs().max().item() < 1e-5


def test_decode_kernel_rejects_head_dim_it_cannot_tile():
    attn, q, tables, seq_lens = random_batch(torch.float32, [5], 72)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        decode("kernel", attn, q, tables, seq_lens)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_sliding_window_decode_attends_only_the_last_window_keys(path, dtype, tol):
    """Windows shorter and longer than a sequence, starting mid-block; 1000 keys split over threads."""
    window = 37
    attn, q, tables, seq_lens = random_batch(dtype, [1, 20, 37, 38, 333, 1000])
    attn.sliding_window = window
    out = decode(path, attn, q, tables, seq_lens)
    ref = []
    for b, n in enumerate(seq_lens.tolist()):
        k = attn.k_cache[:, tables[b]].reshape(KV_HEADS, -1, HEAD_DIM)[:, max(0, n - window):n].float()
        v = attn.v_cache[:, tables[b]].reshape(KV_HEADS, -1, HEAD_DIM)[:, max(0, n - window):n].float()
        ref.append(F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, enable_gqa=True).squeeze(1))
    assert (out.float() - torch.stack(ref)).abs().max().item() < tol
