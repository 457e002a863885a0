"""Quantized KV cache (int8 / fp8 with per-token-per-head scales): round trip, greedy output against the float
cache, and the bytes it saves."""
import pytest
import torch

from conftest import FLOAT32, num_clear_positions, top2_gap
from inferno import LLM, SamplingParams
from inferno.layers.attention import Attention
from inferno.layers.attention.metadata import block_rows
from inferno.layers.kv_quantization import gather_kv, quantize_kv, write_kv
from inferno.worker.model_runner import kv_bytes_per_block
from test_model_vs_hf import PROMPTS

KV_MEMORY = 64 << 20
# Greedy tokens are compared up to the float-cache run's first near-tie: int8 K/V (relative error ~0.5% per vector)
# moves a logit by up to about this
QUANTIZED_KV_LOGIT_TOLERANCE = 0.05


@pytest.mark.parametrize("dtype, tol", [(torch.int8, 0.01), (torch.float8_e4m3fn, 0.07)])
def test_quantized_kv_round_trip_through_cache_slots(dtype, tol):
    kv_heads, num_blocks, block_size, head_dim = 3, 6, 4, 64
    cache = torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    scales = torch.zeros(kv_heads, num_blocks, block_size)
    x = torch.randn(5, kv_heads, head_dim) * torch.tensor([0.1, 1.0, 30.0]).view(1, 3, 1)  # scales per head
    slots = torch.tensor([9, 10, 11, 12, 13])  # blocks 2 and 3
    write_kv(cache, scales, slots, x)
    back = gather_kv(cache, scales, block_rows(torch.tensor([2, 3]), kv_heads, num_blocks), torch.float32)
    back = back[:, 1:6].transpose(0, 1)  # slot 9 is offset 1 of block 2
    assert ((back - x).norm(dim=-1) / x.norm(dim=-1)).max() < tol
    codes, s = quantize_kv(x, dtype)
    assert codes.dtype == dtype and s.shape == x.shape[:-1]


@pytest.fixture(scope="module", params=["int8", "fp8_e4m3"])
def kv_llm(request):
    return LLM(kv_cache_memory=KV_MEMORY, **{**FLOAT32, "kv_cache_dtype": request.param})


@pytest.mark.parametrize("prompt", PROMPTS)
def test_quantized_kv_greedy_matches_float_kv(kv_llm, llm, prompt):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    ref = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    ours = kv_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    clear = num_clear_positions([top2_gap(position) for position in ref.logprobs], QUANTIZED_KV_LOGIT_TOLERANCE,
                                min_compared=4)
    assert ours[:clear] == ref.token_ids[:clear]
    assert kv_llm.llm_engine.num_free_blocks == kv_llm.llm_engine.num_blocks


def test_quantized_kv_shrinks_bytes_per_token(kv_llm, llm):
    runner, float_runner = kv_llm.llm_engine.model_runner, llm.llm_engine.model_runner

    def resident_bytes_per_block(r) -> float:
        tensors = [t for a in r.model.attention_layers for t in (a.k_cache, a.v_cache, a.k_scale, a.v_scale)
                   if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors) / r.num_blocks

    config = kv_llm.llm_engine.model_config
    ratio = resident_bytes_per_block(float_runner) / resident_bytes_per_block(runner)
    assert ratio == pytest.approx(4 / (1 + 4 / config.head_dim))  # fp32 -> 1 byte + a float32 scale per head_dim
    assert resident_bytes_per_block(runner) == kv_bytes_per_block(config, 16, kv_llm.llm_engine.config.kv_cache_dtype)
    float_blocks = KV_MEMORY // kv_bytes_per_block(config, 16, "float32")
    assert kv_llm.llm_engine.num_blocks >= 3.7 * float_blocks  # more blocks in the same kv_cache_memory


def test_bad_kv_cache_dtype_is_rejected():
    from inferno.config import EngineConfig
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_copy_blocks_copies_quantized_codes_and_scales(dtype):
    kv_heads, num_blocks, block_size, head_dim = 2, 5, 4, 32
    attn = Attention(4, kv_heads, head_dim)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    attn.k_cache, attn.v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    attn.k_scale, attn.v_scale = torch.zeros(shape[:-1]), torch.zeros(shape[:-1])
    k, v = torch.randn(2 * block_size, kv_heads, head_dim), torch.randn(2 * block_size, kv_heads, head_dim)
    write_kv(attn.k_cache, attn.k_scale, torch.arange(block_size, 3 * block_size), k)  # blocks 1 and 2
    write_kv(attn.v_cache, attn.v_scale, torch.arange(block_size, 3 * block_size), v)
    attn.copy_blocks(torch.tensor([1, 2]), torch.tensor([4, 3]))

    def read(cache, scales, blocks):
        return gather_kv(cache, scales, block_rows(torch.tensor(blocks), kv_heads, num_blocks), torch.float32)

    for cache, scales in ((attn.k_cache, attn.k_scale), (attn.v_cache, attn.v_scale)):
        assert read(cache, scales, [4, 3]).abs().sum() > 0
        assert torch.equal(read(cache, scales, [4, 3]), read(cache, scales, [1, 2]))


def test_forked_samples_share_the_quantized_prompt(kv_llm):
    """n > 1 samples fork the first sample's prompt blocks and copy the partial one on write (codes and scales):
    greedy samples must all equal the lone greedy completion."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = kv_llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    forked = kv_llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs
    assert [o.token_ids for o in forked] == [alone] * 3
    assert kv_llm.llm_engine.num_free_blocks == kv_llm.llm_engine.num_blocks
