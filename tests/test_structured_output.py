"""Structured outputs: every sampled token is one the grammar allows (llguidance's own matcher is the oracle), outputs
match their schema, regex or choice, and constraints compose with the engine's other features."""
import json
import re
import threading

import jsonschema
import pytest
import torch

from conftest import FLOAT32, assert_all_blocks_free
from inferno import LLM, SamplingParams, StructuredOutputsParams
from inferno.layers.sampler import apply_grammar_bitmask
from inferno.worker.model_runner import kv_bytes_per_block

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "height": {"type": "number", "minimum": 0, "maximum": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "height", "address", "tags"],
    "additionalProperties": False,
}
PERSON_PROMPT = [{"role": "user", "content": "A person as JSON."}]


def constrained(max_tokens: int = 64, **kwargs) -> SamplingParams:
    names = {"json", "regex", "choice", "grammar", "json_object"}
    outputs = StructuredOutputsParams(**{k: v for k, v in kwargs.items() if k in names})
    return SamplingParams(max_tokens=max_tokens, structured_outputs=outputs,
                          **{k: v for k, v in kwargs.items() if k not in names})


def leftover_grammars(llm: LLM) -> int:
    manager = llm.llm_engine.structured_output
    return len(manager.grammars) + len(manager.pending)


# the mask
def test_bitmasks_with_drafts_match_the_grammar_library_matcher(llm):
    """Each row of a step's bitmask (the sampled position, then after each draft) allows exactly the tokens
    llguidance's matcher allows there, and computing them leaves the request's matcher where it was."""
    engine = llm.llm_engine
    manager, tokenizer = engine.structured_output, engine.tokenizer
    manager.add_request("oracle", StructuredOutputsParams(json=PERSON))
    manager.wait_for_compile(30)
    grammar = manager.grammar_of("oracle")
    try:
        text = '{"name": "Ada", "age": 36, "role": "admin", "height": 1.7, "address": {'
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert grammar.accept_token(tokens[0])
        drafts = tokens[1:6]
        masks = manager.bitmasks({"oracle": drafts})["oracle"]
        assert masks.shape[0] == 1 + len(drafts)
        oracle = grammar.matcher.deep_copy()
        vocab = engine.model_config.vocab_size
        for j in range(len(drafts) + 1):
            expected = torch.frombuffer(bytearray(oracle.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
            logits = apply_grammar_bitmask(torch.zeros(1, vocab), [0], masks[j:j + 1])
            assert torch.equal(logits[0] == 0, expected), f"position {j}"
            if j < len(drafts):
                assert oracle.consume_token(drafts[j])
        assert grammar.num_valid_tokens(tokens[1:]) == len(tokens) - 1  # not advanced by the bitmasks
    finally:
        manager.remove("oracle")


def test_mask_applies_only_to_constrained_rows():
    logits = torch.randn(3, 70)
    allowed = torch.zeros(1, 3, dtype=torch.int32)
    allowed[0, 2] = 1 << 1  # token 65 only
    masked = apply_grammar_bitmask(logits.clone(), [1], allowed)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert masked[1].isfinite().nonzero().flatten().tolist() == [65]


# outputs
def test_sampled_json_always_matches_a_nested_schema(llm):
    outputs = llm.chat(PERSON_PROMPT, constrained(max_tokens=64, json=PERSON, temperature=1.0, n=20, seed=7),
                       use_tqdm=False)
    for completion in outputs[0].outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert_all_blocks_free(llm.llm_engine)
    assert leftover_grammars(llm) == 0


def test_regex_and_choice_always_match(llm):
    regex = r"[A-Z]{2}-\d{3}( [a-z]{1,8})?"
    choices = ["red", "green", "blue", "dark red"]
    outputs = llm.generate(["The code is", "My favourite colour is"],
                           [constrained(regex=regex, temperature=1.0, n=8, seed=1),
                            constrained(choice=choices, temperature=1.0, n=8, seed=2)], use_tqdm=False)
    assert all(re.fullmatch(regex, c.text) for c in outputs[0].outputs)
    assert all(c.text in choices for c in outputs[1].outputs)
    assert all(c.finish_reason == "stop" for o in outputs for c in o.outputs)


def test_json_object_and_grammar(llm):
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
    outputs = llm.generate(["Write a JSON object:", "A sum:"],
                           [constrained(json_object=True, temperature=0.7, seed=3, max_tokens=80),
                            constrained(grammar=grammar, temperature=1.0, seed=4)], use_tqdm=False)
    obj = outputs[0].outputs[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", outputs[1].outputs[0].text)


def test_logprobs_are_those_of_the_masked_distribution(llm):
    out = llm.generate("Is water wet? Answer:", constrained(choice=["yes", "no"], temperature=0, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    first = out.logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob > float("-inf")}
    tokenizer = llm.get_tokenizer()
    assert {tokenizer.id_to_token(t) for t in finite} <= {"yes", "no", "y", "n", "ye"}
    assert sum(torch.tensor(list(finite.values())).exp()) == pytest.approx(1.0, abs=1e-4)


def test_seeded_samples_repeat_and_stop_strings_still_apply(llm):
    params = constrained(json=PERSON, temperature=1.0, seed=11, n=2, max_tokens=64)
    first, second = (llm.chat(PERSON_PROMPT, params, use_tqdm=False)[0] for _ in range(2))
    assert [c.text for c in first.outputs] == [c.text for c in second.outputs]
    stopped = llm.chat(PERSON_PROMPT, constrained(json=PERSON, temperature=1.0, seed=11, n=2, max_tokens=64,
                                                  stop=['"age"']), use_tqdm=False)[0]
    for full, cut in zip(first.outputs, stopped.outputs):
        assert cut.stop_reason == '"age"' and full.text.startswith(cut.text)


def test_chunked_prefill_preemption_prefix_cache_and_speculation_keep_greedy_outputs(llm, model_path):
    """Greedy constrained outputs are the same on a tiny cache (preemption) with small chunks, prefix-cache hits
    and n-gram drafts (checked against the grammar before they are verified)."""
    example = '{"name": "Ada", "age": 36, "role": "admin", "height": 1.7, "address": {"zip": "75001"}, "tags": ["a"]}'
    prompts = [[{"role": "user", "content": f"Repeat this JSON exactly: {example} (copy {i})"}] for i in range(4)]
    params = constrained(json=PERSON, temperature=0, max_tokens=64)
    reference = [o.outputs[0].text for o in llm.chat(prompts, params, use_tqdm=False)]
    block_bytes = kv_bytes_per_block(llm.llm_engine.model_config, 16, llm.llm_engine.config.kv_cache_dtype)
    other = LLM(model_path, kv_cache_memory=12 * block_bytes, max_num_batched_tokens=48, **FLOAT32,
                speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                    "disable_by_batch_size": None, "draft_acceptance_threshold": 0})
    assert [o.outputs[0].text for o in other.chat(prompts, params, use_tqdm=False)] == reference
    engine = other.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.spec_decoding_stats.num_accepted_tokens > 0
    assert engine.kv_cache_manager.prefix_cache_hits > 0
    assert_all_blocks_free(engine)
    assert leftover_grammars(other) == 0


# the engine around the grammar
def test_request_waits_for_its_grammar_while_others_decode(llm, monkeypatch):
    engine = llm.llm_engine
    manager = engine.structured_output
    release = threading.Event()
    compile_grammar = manager._compile
    monkeypatch.setattr(manager, "_compile", lambda spec: release.wait(30) and compile_grammar(spec))
    engine.add_request("slow", "A number:", constrained(regex=r"\d{4}0{7}", temperature=0, max_tokens=16))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished = {}
    for _ in range(3):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "plain" in finished and "slow" not in finished
    assert [r.request_id for r in engine.scheduler.waiting] == ["slow"]
    release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch(r"\d{4}0{7}", finished["slow"].outputs[0].text)
    assert_all_blocks_free(engine)


def test_grammar_that_fails_to_compile_ends_only_its_request(llm, monkeypatch):
    engine = llm.llm_engine

    def fail(spec):
        raise ValueError("structured_outputs could not be compiled: too complex")

    monkeypatch.setattr(engine.structured_output, "_compile", fail)
    engine.add_request("bad", "Hi", constrained(regex=r"fails to compile \d+"))
    engine.add_request("good", "Hi", SamplingParams(max_tokens=4, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "too complex" in finished["bad"].error
    assert finished["good"].error is None and len(finished["good"].outputs[0].token_ids) == 4
    assert leftover_grammars(llm) == 0
    assert_all_blocks_free(engine)


def test_abort_mid_grammar_leaves_no_blocks_or_matchers(llm):
    engine = llm.llm_engine
    engine.add_request("aborted", "Some JSON:", constrained(json=PERSON, temperature=1.0, n=3, max_tokens=100))
    for _ in range(4):
        engine.step()
    assert len(engine.structured_output.grammars) == 3
    engine.abort_request("aborted")
    engine.step()
    assert leftover_grammars(llm) == 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("outputs, message", [
    (lambda: StructuredOutputsParams(), "exactly one"),
    (lambda: StructuredOutputsParams(regex="a", choice=["a"]), "exactly one"),
    (lambda: StructuredOutputsParams(choice="abc"), "list of non-empty strings"),
])
def test_bad_structured_outputs_params_raise(outputs, message):
    with pytest.raises(ValueError, match=message):
        outputs()


@pytest.mark.parametrize("params, message", [
    (StructuredOutputsParams(json='{"type": "integer", "minimum": "x"}'), "invalid"),
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(regex="a(b"), "invalid"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "invalid"),
    (StructuredOutputsParams(regex="a" * (300 << 10)), "at most"),
])
def test_bad_grammars_raise_value_error_and_leave_nothing_behind(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("Hi", SamplingParams(structured_outputs=params), use_tqdm=False)
    assert leftover_grammars(llm) == 0
    assert_all_blocks_free(llm.llm_engine)


def test_beam_search_rejects_constraints():
    with pytest.raises(ValueError, match="structured_outputs is not supported with use_beam_search"):
        SamplingParams(n=2, use_beam_search=True, temperature=0,
                       structured_outputs=StructuredOutputsParams(choice=["a"]))

