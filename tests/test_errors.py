"""Bad input gets a clear ValueError where it enters and leaves the engine usable; a failed step ends only
its own requests."""

import pytest

from conftest import assert_all_blocks_free
from inferno import LLM, SamplingParams


def still_works(llm) -> None:
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_all_blocks_free(llm.llm_engine)


@pytest.mark.parametrize("params, field", [
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=0), "max_tokens"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(temperature=-0.5), "temperature"), (dict(n=0), "n"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
])
def test_invalid_sampling_params_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**params)


def test_prompt_too_long_is_rejected(llm):
    too_long = [1] * llm.llm_engine.max_model_len
    with pytest.raises(ValueError, match=f"prompt has {len(too_long)} tokens but max_model_len is"):
        llm.generate({"prompt_token_ids": too_long}, SamplingParams(max_tokens=4), use_tqdm=False)
    still_works(llm)


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt must not be empty"), ({"prompt_token_ids": []}, "prompt must not be empty"),
    ({"prompt_token_ids": [1, 10**9]}, "out of range"), ({"prompt_token_ids": [1, -1]}, "out of range"),
    ({"text": "x"}, "prompt must be"),
])
def test_bad_prompts_are_rejected(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
    still_works(llm)


def test_bad_prompt_in_a_batch_adds_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", "also fine", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.llm_engine.get_num_unfinished_requests() == 0
    still_works(llm)


def test_values_beyond_the_vocabulary_are_rejected(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    for params in (SamplingParams(stop_token_ids=[vocab]), SamplingParams(logprobs=vocab + 1),
                   SamplingParams(prompt_logprobs=vocab + 1)):
        with pytest.raises(ValueError, match="vocab"):
            llm.generate("Hello", params, use_tqdm=False)
    still_works(llm)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="config.json is missing"):
        LLM(model=str(tmp_path))


def test_corrupt_gguf(tmp_path, model_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        LLM(model=str(garbage))
    truncated = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as src, open(truncated, "wb") as dst:
        dst.write(src.read(5_000_000))
    with pytest.raises(ValueError, match="GGUF"):
        LLM(model=str(truncated))


def test_max_model_len_larger_than_the_model_is_rejected(model_path):
    with pytest.raises(ValueError, match="larger than the model's context length"):
        LLM(model=model_path, max_model_len=10**6)


def test_failed_step_ends_its_requests_and_engine_goes_on(llm, monkeypatch):
    runner = llm.llm_engine.model_runner

    def broken(_):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(runner, "execute_model", broken)
    outs = llm.generate(["one", "two"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert all(o.finished and o.outputs[0].finish_reason == "error" for o in outs)
    assert "simulated kernel failure" in outs[0].error
    monkeypatch.undo()
    still_works(llm)
