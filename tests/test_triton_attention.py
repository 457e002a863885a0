"""The Triton attention kernels (the GPU backend's) agree with dense SDPA: on CUDA when there is a GPU, else on a CPU
under Triton's interpreter (inputs made on the CPU, the references computed there)."""
import pytest
import torch
import torch.nn.functional as F

triton_attention = pytest.importorskip("inferno.kernels.triton_attention", reason="triton is not installed")

KV_HEADS, BLOCK, NUM_BLOCKS = 2, 16, 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def random_cache(head_dim: int, dtype: torch.dtype):
    return (torch.randn(KV_HEADS, NUM_BLOCKS, BLOCK, head_dim).to(dtype),
            torch.randn(KV_HEADS, NUM_BLOCKS, BLOCK, head_dim).to(dtype))


def keys_of(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    return cache[:, table].reshape(KV_HEADS, -1, cache.shape[-1])[:, :n].float()


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, window: int,
              softcap: float | None, scale: float) -> torch.Tensor:
    """q [Q, H, D] at `positions`, k/v [KVH, K, D] -> [Q, H, D], causal (and windowed), soft-capped."""
    group = q.shape[1] // k.shape[0]
    scores = torch.einsum("qhd,hkd->hqk", q.float(), k.repeat_interleave(group, 0)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    keys = torch.arange(k.shape[1])
    visible = keys[None, :] <= positions[:, None]
    if window:
        visible &= keys[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,hkd->qhd", scores, v.repeat_interleave(group, 0))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("head_dim, heads", [(64, 6), (80, 2), (128, 8)])
def test_decode_matches_reference(dtype, tol, head_dim, heads):
    torch.manual_seed(0)
    k_cache, v_cache = random_cache(head_dim, dtype)
    seq_lens = [1, 17, 600]  # 600: two partitions of 512 keys, merged
    width = max(-(-n // BLOCK) for n in seq_lens)
    tables = torch.stack([torch.randperm(NUM_BLOCKS)[:width] for _ in seq_lens]).int()
    q = torch.randn(len(seq_lens), heads, head_dim).to(dtype)
    out = triton_attention.paged_decode_attention(*on_device(q, k_cache, v_cache, tables, torch.tensor(seq_lens).int()),
                                                  0.1).cpu()
    assert out.dtype == dtype
    for b, n in enumerate(seq_lens):
        ref = reference(q[b:b + 1], keys_of(k_cache, tables[b], n), keys_of(v_cache, tables[b], n),
                        torch.tensor([n - 1]), 0, None, 0.1)
        assert (out[b].float() - ref[0]).abs().max().item() < tol


@pytest.mark.parametrize("window, softcap", [(37, None), (0, 5.0), (100, 3.0)])
def test_decode_sliding_window_and_softcap(window, softcap):
    torch.manual_seed(1)
    k_cache, v_cache = random_cache(64, torch.float32)
    seq_lens = [1, 30, 37, 38, 550]
    tables = torch.stack([torch.randperm(NUM_BLOCKS)[:35] for _ in seq_lens]).int()
    q = torch.randn(len(seq_lens), 4, 64)
    out = triton_attention.paged_decode_attention(*on_device(q, k_cache, v_cache, tables, torch.tensor(seq_lens).int()),
                                                  0.125, window, softcap).cpu()
    for b, n in enumerate(seq_lens):
        ref = reference(q[b:b + 1], keys_of(k_cache, tables[b], n), keys_of(v_cache, tables[b], n),
                        torch.tensor([n - 1]), window, softcap, 0.125)
        assert (out[b] - ref[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window, softcap", [(0, None), (20, None), (0, 4.0)])
def test_prefill_over_cached_context(dtype, tol, window, softcap):
    """Chunks with no context, with a cached prefix (prefix hit / later chunk of a chunked prefill), and one longer
    than a query tile, packed one after another."""
    torch.manual_seed(2)
    head_dim, heads = 64, 4
    k_cache, v_cache = random_cache(head_dim, dtype)
    chunks = [(0, 5), (40, 7), (3, 70)]  # (tokens cached before, new tokens)
    seq_lens = [c + n for c, n in chunks]
    width = max(-(-n // BLOCK) for n in seq_lens)
    tables = torch.stack([torch.randperm(NUM_BLOCKS)[:width] for _ in chunks]).int()
    starts = torch.tensor([0, 5, 12, 82]).int()
    q = torch.randn(82, heads, head_dim).to(dtype)
    out = triton_attention.paged_prefill_attention(
        *on_device(q, k_cache, v_cache, tables, starts, torch.tensor(seq_lens).int()), 70, 0.125, window, softcap).cpu()
    for i, (context, n) in enumerate(chunks):
        rows = slice(starts[i].item(), starts[i + 1].item())
        ref = reference(q[rows], keys_of(k_cache, tables[i], context + n), keys_of(v_cache, tables[i], context + n),
                        torch.arange(context, context + n), window, softcap, 0.125)
        assert (out[rows].float() - ref).abs().max().item() < tol


def test_write_kv_fills_slots_and_skips_padding():
    torch.manual_seed(3)
    k_cache, v_cache = (torch.zeros(KV_HEADS, NUM_BLOCKS, BLOCK, 64, device=DEVICE) for _ in range(2))
    qkv, slots = on_device(torch.randn(5, 4 + 2 * KV_HEADS, 64), torch.tensor([0, 17, 33, -1, 1023]))
    k, v = qkv[:, 4:4 + KV_HEADS], qkv[:, 4 + KV_HEADS:]  # strided views of a fused projection, as in the model
    triton_attention.write_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(KV_HEADS, -1, 64), v_cache.view(KV_HEADS, -1, 64)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[:, slot], k[t]) and torch.equal(flat_v[:, slot], v[t])
    assert int((flat_k != 0).any(-1).sum()) == 4 * KV_HEADS  # the padded row wrote nothing


# gemma2: a sliding-window layer beside a global one, soft-capped scores, head size 16; qwen3: head size 32
@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_model_on_the_triton_backend_matches_hf(tmp_path, arch):
    """The whole model with every attention in the Triton kernels: prefill logits, greedy tokens alone, batched,
    chunked and preempted (prefills over cached context), as HF transformers computes them."""
    from inferno import LLM
    from conftest import FLOAT32
    from test_architectures import assert_matches_hf, prompts
    from tiny_models import write_hf_model
    hf_model = write_hf_model(tmp_path, arch)
    llm = LLM(model=str(tmp_path), **FLOAT32, kv_cache_memory=8 << 20,
              attention_backend="triton")
    assert llm.llm_engine.model_runner.attention.name == "triton"
    assert_matches_hf(hf_model, llm, prompts([200])[0], prompts([5, 40, 70, 23]), attention_backend="triton")
