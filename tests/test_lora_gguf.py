"""llama.cpp's GGUF LoRA files read back into PEFT's form: the tensors and the scaling of the PEFT adapter they were
converted from (peft is the oracle), and clear errors for files that are not GGUF LoRAs."""
import copy

import gguf
import numpy as np
import peft
import pytest
import torch

from inferno import LLM, LoRARequest, SamplingParams
from inferno.config import ModelConfig
from inferno.loader.lora_gguf import read_gguf_adapter
from tiny_lora import peft_adapter_tensors, write_gguf_lora, write_peft_adapter
from tiny_models import write_gguf, write_hf_model, write_tokenizer

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_config(hf_config) -> ModelConfig:
    """The head counts read_gguf_adapter needs, from the HF config (the rest is not read)."""
    return ModelConfig("llama", hf_config.vocab_size, hf_config.hidden_size, hf_config.intermediate_size,
                       hf_config.num_hidden_layers, hf_config.num_attention_heads, hf_config.num_key_value_heads,
                       hf_config.hidden_size // hf_config.num_attention_heads, 1e-6, 1e4, 512, False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


def peft_model_from(hf_model, config: dict, tensors: dict[str, torch.Tensor]) -> peft.PeftModel:
    """A PEFT model built from read_gguf_adapter's output: what PEFT makes of the config and tensors."""
    options = {k: v for k, v in config.items() if k not in ("peft_type", "base_model_name_or_path")}
    model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(**options))
    result = peft.set_peft_model_state_dict(model, tensors)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    return model.eval()


@torch.inference_mode()
def assert_same_logits(reference: peft.PeftModel, model: peft.PeftModel, base) -> None:
    ids = torch.tensor([[5, 40, 17, 99, 3, 200, 64, 8]])
    expected = reference(ids).logits
    assert not torch.allclose(expected, base(ids).logits, atol=1e-2)  # the adapter changes the outputs
    torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-5)


def test_llama_lora_reads_back_as_the_peft_adapter(llama, tmp_path):
    reference = write_peft_adapter(tmp_path / "adapter", llama, 8, ALL_PROJECTIONS, seed=1, lora_alpha=16)
    path = write_gguf_lora(tmp_path / "adapter.gguf", tmp_path / "adapter", llama.config, "llama")
    config, tensors = read_gguf_adapter(str(path), model_config(llama.config))
    expected = peft_adapter_tensors(tmp_path / "adapter")
    assert tensors.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(tensors[key], tensor), key  # q/k B rows back in HF's order
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (8, 16.0, sorted(ALL_PROJECTIONS))
    assert_same_logits(reference, peft_model_from(llama, config, tensors), llama)


def test_qwen3_lora_with_per_module_ranks_keeps_llama_cpp_scaling(qwen3, tmp_path):
    """llama.cpp scales each pair by alpha / its own rank: PEFT's rank_pattern, so PEFT computes the same model."""
    reference = write_peft_adapter(tmp_path / "adapter", qwen3, 4, ["q_proj", "v_proj", "down_proj"], seed=2,
                                   lora_alpha=8, rank_pattern={"down_proj": 12})
    path = write_gguf_lora(tmp_path / "adapter.gguf", tmp_path / "adapter", qwen3.config, "qwen3")
    config, tensors = read_gguf_adapter(str(path))  # no rotary reordering outside `llama` files
    assert config["r"] == 4 and set(config["rank_pattern"].values()) == {12}
    assert_same_logits(reference, peft_model_from(qwen3, config, tensors), qwen3)


def test_alpha_zero_means_a_scale_of_one(qwen3, tmp_path):
    write_peft_adapter(tmp_path / "adapter", qwen3, 4, ["q_proj"], seed=3)
    path = write_gguf_lora(tmp_path / "adapter.gguf", tmp_path / "adapter", qwen3.config, "qwen3", lora_alpha=0.0)
    config, _ = read_gguf_adapter(str(path))
    assert config["lora_alpha"] / config["r"] == 1.0


def test_float16_pairs_read_as_float32(qwen3, tmp_path):
    write_peft_adapter(tmp_path / "adapter", qwen3, 4, ["o_proj", "up_proj"], seed=4)
    path = write_gguf_lora(tmp_path / "adapter.gguf", tmp_path / "adapter", qwen3.config, "qwen3", np.float16)
    _, tensors = read_gguf_adapter(str(path))
    for key, tensor in peft_adapter_tensors(tmp_path / "adapter").items():
        assert tensors[key].dtype == torch.float32
        torch.testing.assert_close(tensors[key], tensor.half().float(), rtol=0, atol=0)


def write_adapter(path, arch: str, tensors: dict[str, np.ndarray], alpha: float = 8.0, general_type: str = "adapter",
                  adapter_type: str = "lora"):
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


A, B = np.ones((4, 64), np.float32), np.ones((64, 4), np.float32)


@pytest.mark.parametrize("tensors, kwargs, message", [
    ({"blk.0.attn_q.weight.lora_a": A}, {}, "lacks the lora_b half"),
    ({"blk.0.attn_q.weight.lora_a": A, "blk.0.attn_q.weight.lora_b": B[:, :2]}, {}, "do not share a rank"),
    ({"blk.0.attn_norm.weight": A[0]}, {}, "not a LoRA pair's half"),
    ({"blk.0.attn_nope.weight.lora_a": A, "blk.0.attn_nope.weight.lora_b": B}, {}, "models do not have"),
    ({"blk.0.ffn_up_exps.weight.lora_a": A, "blk.0.ffn_up_exps.weight.lora_b": B}, {}, "routed experts"),
    ({}, {}, "holds no LoRA tensors"),
    ({"blk.0.attn_q.weight.lora_a": A, "blk.0.attn_q.weight.lora_b": B}, {"adapter_type": "control_vector"},
     "only 'lora' adapters"),
    ({"blk.0.attn_q.weight.lora_a": A, "blk.0.attn_q.weight.lora_b": B}, {"general_type": "model"},
     "is not a GGUF adapter"),
])
def test_bad_adapter_files_raise_clear_errors(tmp_path, tensors, kwargs, message):
    path = write_adapter(tmp_path / "bad.gguf", "qwen3", tensors, **kwargs)
    with pytest.raises(ValueError, match=message):
        read_gguf_adapter(path)


def test_token_embedding_pairs_read_as_peft_embedding_lora(tmp_path):
    """llama.cpp stores token_embd's A transposed ([vocab, r], rows looked up); PEFT's lora_embedding_A is [r, vocab]."""
    a, b = np.arange(24, dtype=np.float32).reshape(6, 4), np.ones((64, 4), np.float32)
    path = write_adapter(tmp_path / "embd.gguf", "qwen3", {"token_embd.weight.lora_a": a, "token_embd.weight.lora_b": b})
    config, tensors = read_gguf_adapter(path)
    assert torch.equal(tensors["base_model.model.model.embed_tokens.lora_embedding_A"], torch.from_numpy(a.T))
    assert tensors["base_model.model.model.embed_tokens.lora_embedding_B"].shape == (64, 4)
    assert config["r"] == 4 and config["target_modules"] == ["embed_tokens"]


def test_llama_q_without_the_base_config_is_refused(tmp_path):
    path = write_adapter(tmp_path / "llama.gguf", "llama",
                         {"blk.0.attn_q.weight.lora_a": A, "blk.0.attn_q.weight.lora_b": B})
    with pytest.raises(ValueError, match="needs the base model's config"):
        read_gguf_adapter(path)


def test_a_base_model_file_or_a_missing_file_is_refused(qwen3, tmp_path):
    with pytest.raises(ValueError, match="is not a GGUF adapter"):
        read_gguf_adapter(str(write_gguf(tmp_path / "model.gguf", qwen3, "qwen3")))
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        read_gguf_adapter(str(tmp_path / "missing.gguf"))


# end to end: the engine runs a GGUF LoRA file as it runs the PEFT adapter it was converted from
LLM_ARGS = dict(dtype="float32", kv_cache_dtype="float32", quantization=None, enforce_eager=True,
                kv_cache_memory=16 << 20, enable_lora=True, max_loras=2, max_lora_rank=16)
PROMPT = [(5 * i + 11) % 256 for i in range(24)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_gguf_lora_runs_as_its_peft_adapter(arch, tmp_path, request):
    hf_model = request.getfixturevalue(arch)
    folder = tmp_path / "base"
    hf_model.save_pretrained(folder)
    write_tokenizer(folder)
    write_peft_adapter(tmp_path / "adapter", hf_model, 8, ALL_PROJECTIONS, seed=5)
    path = write_gguf_lora(tmp_path / "adapter.gguf", tmp_path / "adapter", hf_model.config, arch)
    llm = LLM(str(folder), **LLM_ARGS)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0)
    peft_form, gguf_form, base = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 3, params, use_tqdm=False,
        lora_request=[LoRARequest("peft", 1, str(tmp_path / "adapter")), LoRARequest("gguf", 2, str(path)), None])
    assert gguf_form.outputs[0].token_ids == peft_form.outputs[0].token_ids
    assert prompt_logprobs(gguf_form) == pytest.approx(prompt_logprobs(peft_form), abs=1e-5)
    assert prompt_logprobs(base) != pytest.approx(prompt_logprobs(peft_form), abs=1e-2)


def prompt_logprobs(output) -> list[float]:
    return [position[token].logprob for position, token in zip(output.prompt_logprobs[1:], PROMPT[1:])]
