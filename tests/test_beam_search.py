"""Beam search equals HF transformers' generate(num_beams=...) on the default model, and frees its forked blocks."""
import pytest
import torch

from conftest import assert_all_blocks_free
from inferno import SamplingParams

CASES = [  # prompt, beam width, max new tokens, length_penalty, early_stopping
    ("The capital of France is", 3, 12, 1.0, False),
    ("<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n", 4, 24, 1.0, True),
    ("def add(a, b):\n", 2, 16, 0.5, False),
    ("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", 3, 20, 2.0, "never"),
]


@torch.inference_mode()
def hf_beam_search(hf_model, ids, eos, width, max_tokens, length_penalty, early_stopping):
    out = hf_model.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width, do_sample=False,
                            max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
                            eos_token_id=sorted(eos), output_scores=True, return_dict_in_generate=True,
                            pad_token_id=0)
    sequences = []
    for row in out.sequences[:, len(ids):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        sequences.append(row[:end])
    return sequences, out.sequences_scores.tolist()


@pytest.mark.parametrize("prompt, width, max_tokens, length_penalty, early_stopping", CASES)
def test_beam_search_matches_hf(llm, hf_model, prompt, width, max_tokens, length_penalty, early_stopping):
    ids = llm.get_tokenizer().encode(prompt)
    eos = llm.get_tokenizer().eos_token_ids  # the GGUF's EOS and its chat template's end-of-turn token
    ref, ref_scores = hf_beam_search(hf_model, ids, eos, width, max_tokens, length_penalty, early_stopping)
    (out,) = llm.beam_search({"prompt_token_ids": ids}, width, max_tokens, length_penalty, early_stopping)
    assert [c.token_ids for c in out.outputs] == ref
    for c, score in zip(out.outputs, ref_scores):
        assert c.cumulative_logprob / len(c.token_ids) ** length_penalty == pytest.approx(score, abs=1e-3)
    assert out.outputs[0].text == llm.get_tokenizer().decode(ref[0][:-1] if ref[0][-1] in eos else ref[0])
    assert_all_blocks_free(llm.llm_engine)


def test_beams_share_blocks(llm):
    """While beams run, their common prefix is stored once: far fewer blocks than width separate sequences."""
    engine = llm.llm_engine
    ids = llm.get_tokenizer().encode("Once upon a time " * 30)  # 150 tokens: 9 full blocks
    engine.add_request("beams", {"prompt_token_ids": ids},
                       SamplingParams(n=4, use_beam_search=True, max_tokens=8, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.num_blocks - engine.num_free_blocks)
    own = -(-(len(ids) + 8) // 16)
    assert own <= peak <= own + 2 * 4  # the prompt once, plus a partial block per beam and copies in flight
    assert_all_blocks_free(engine)


def test_beam_search_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("beam-abort", "Tell me a story", SamplingParams(n=3, use_beam_search=True, max_tokens=50))
    for _ in range(4):
        engine.step()
    engine.abort_request("beam-abort")
    assert_all_blocks_free(engine)
    assert engine.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("field, value", [("logprobs", 2), ("stop", ["x"]), ("min_tokens", 2),
                                          ("repetition_penalty", 1.2)])
def test_beam_search_rejects_unsupported_params(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(n=2, use_beam_search=True, **{field: value})


def test_early_stopping_is_validated():
    with pytest.raises(ValueError, match="early_stopping"):
        SamplingParams(n=2, use_beam_search=True, early_stopping="sometimes")
