"""The model matches HF transformers on the same weights: prefill logits and greedy generation."""
import pytest
import torch

from conftest import FLOAT32, num_clear_positions, prefill_logits
from inferno import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. In 1492, Columbus",
    "Hello",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]
# greedy decode logits vs HF's: looser than the prefill's 1e-3 (HF's cached decode sums in another order)
GREEDY_LOGIT_TOLERANCE = 0.01


@torch.inference_mode()
def hf_greedy(hf_model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and, per step, the gap between its top-2 logits."""
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                            output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(ids):].tolist(), margins


def assert_greedy_equal(ours: list[int], ref: list[int], margins: list[float], min_compared: int) -> None:
    """Token-for-token equality up to the first near-tie of the reference."""
    clear = num_clear_positions(margins, GREEDY_LOGIT_TOLERANCE, min_compared)
    assert ours[:clear] == ref[:clear], (ours, ref)
    if clear == len(margins):
        assert ours == ref


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_logits_match_hf(llm, hf_model, prompt):
    ids = llm.get_tokenizer().encode(prompt)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    ours = prefill_logits(llm.llm_engine, ids)
    assert (ours - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("prompt", PROMPTS[:1] + PROMPTS[2:])
def test_greedy_32_tokens_match_hf(llm, hf_model, prompt):
    ids = llm.get_tokenizer().encode(prompt)
    ref, margins = hf_greedy(hf_model, ids, 32)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=32))
    assert_greedy_equal(out[0].outputs[0].token_ids, ref, margins, min_compared=min(16, len(ref)))


def write_tiny_hf_model(folder, tokenizer, kind: str, hidden_size: int = 64) -> None:
    """A random 2-layer model with 4 query / 2 KV heads (head size hidden_size / 4), saved as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    common = dict(vocab_size=tokenizer.vocab_size, hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=False))
        with torch.no_grad():  # random biases so the QKV-bias path is really exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = LlamaForCausalLM(LlamaConfig(**common, rope_scaling=rope, tie_word_embeddings=True))
    model.save_pretrained(folder)
    tokenizer._tokenizer.save(str(folder / "tokenizer.json"))
    return model.eval()


def test_head_size_the_native_kernel_cannot_tile_decodes_on_the_pytorch_path(llm, tmp_path):
    """Head size 24 is no multiple of the kernel's 16 lanes: decode attention takes the PyTorch path, and each
    decoded token's log-probability is HF's for the same sequence (the random model's near-ties make token
    equality meaningless)."""
    hf_model = write_tiny_hf_model(tmp_path, llm.get_tokenizer(), "qwen2", hidden_size=96)
    tiny = LLM(model=str(tmp_path), kv_cache_memory=16 << 20, **FLOAT32)
    assert tiny.llm_engine.model_config.head_dim == 24 and tiny.llm_engine.model_runner.attention.name == "torch"
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    out = tiny.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    assert len(out.token_ids) == 16
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1].log_softmax(dim=-1)
    for i, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(logprobs[token].logprob - ref[i, token].item()) < 1e-3


@pytest.mark.parametrize("kind", ["qwen2", "llama3_rope_scaling"])
def test_hf_folder_model_matches_hf(llm, tmp_path, kind):
    hf_model = write_tiny_hf_model(tmp_path, llm.get_tokenizer(), kind)
    tiny = LLM(model=str(tmp_path), kv_cache_memory=16 << 20, **FLOAT32)
    ids = llm.get_tokenizer().encode(PROMPTS[0] * 8)[:300]  # long enough for llama-3 scaling to matter
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0]
    ours = prefill_logits(tiny.llm_engine, ids)
    assert (ours - ref).abs().max().item() < 1e-3
    ref_tokens, margins = hf_greedy(hf_model, ids[:20], 32)
    out = tiny.generate({"prompt_token_ids": ids[:20]}, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert_greedy_equal(out[0].outputs[0].token_ids, ref_tokens, margins, min_compared=1)
