"""Speculative decoding in the batched engine: the output is the target's, whatever the proposer; no block leaks."""
import pytest

from conftest import assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.worker.model_runner import kv_bytes_per_block

MAX_TOKENS = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    story = tok.encode("The old fisherman told stories about the storms he had seen, the fish he had caught and the "
                       "friends he had lost. Every night he told them again: ")
    code = tok.encode("def area(width, height):\n    return width * height\n\n\ndef volume(width, height, depth):\n")
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]),
                      add_special_tokens=False)
    return [story * 2, code, chat]


@pytest.fixture(scope="module")
def ngram_llm(model_path) -> LLM:
    return LLM(model_path, kv_cache_memory=64 << 20, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def self_draft_llm(model_path) -> LLM:
    """The default model as its own draft: every proposal must be accepted."""
    return LLM(model_path, kv_cache_memory=64 << 20,
               speculative_config={"method": "draft_model", "model": model_path, "num_speculative_tokens": 3})


def greedy(**params) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **params})


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_all_blocks_free(llm.llm_engine)
    return [o.outputs[0] for o in outputs]


def token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [c.token_ids for c in generate(llm, prompts, params)]


@pytest.fixture(scope="module")
def reference(llm, prompts) -> list[list[int]]:
    return token_ids(llm, prompts, greedy())


@pytest.mark.parametrize("spec_llm", ["ngram_llm", "self_draft_llm"])
def test_greedy_speculation_matches_plain_decoding_alone_and_in_batch(request, spec_llm, prompts, reference):
    spec_llm = request.getfixturevalue(spec_llm)
    stats = spec_llm.llm_engine.spec_decoding_stats
    before = stats.num_accepted_tokens
    assert token_ids(spec_llm, prompts[:1], greedy()) == reference[:1]
    assert token_ids(spec_llm, prompts, greedy()) == reference
    assert stats.num_accepted_tokens - before > len(prompts)  # several tokens per step were really taken
    if spec_llm.llm_engine.config.speculative_config.method == "draft_model":
        # the default model as its own draft: every proposal is accepted
        assert stats.acceptance_rate == 1.0
        assert stats.acceptance_rate_per_pos == [1.0, 1.0, 1.0]


def test_mixed_batch_with_requests_that_do_not_speculate(llm, ngram_llm, prompts, reference):
    """A request with logprobs does not speculate; it shares steps with ones that do."""
    params = [greedy(), greedy(logprobs=2), greedy(prompt_logprobs=1)]
    spec = generate(ngram_llm, prompts, params)
    plain = generate(llm, prompts, params)
    assert [c.token_ids for c in spec] == reference
    assert [[list(p) for p in c.logprobs] for c in spec if c.logprobs] == \
        [[list(p) for p in c.logprobs] for c in plain if c.logprobs]


def test_stops_inside_accepted_drafts_match_plain_decoding(ngram_llm, llm, prompts, reference):
    """EOS / stop token / stop string / max_tokens are checked token by token through the accepted drafts."""
    text = generate(llm, prompts[:1], greedy())[0].text
    stop_word = text.split()[3]
    for params in (greedy(stop=[stop_word]), greedy(stop_token_ids=[reference[0][9]]), greedy(max_tokens=7)):
        spec, plain = generate(ngram_llm, prompts[:1], params)[0], generate(llm, prompts[:1], params)[0]
        assert (spec.text, spec.token_ids, spec.finish_reason, spec.stop_reason) == \
            (plain.text, plain.token_ids, plain.finish_reason, plain.stop_reason)
        assert len(spec.token_ids) < MAX_TOKENS


def test_penalties_and_min_tokens_see_the_drafts_before_each_position(llm, ngram_llm, prompts):
    params = greedy(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, min_tokens=5,
                    ignore_eos=False, max_tokens=16)
    assert token_ids(ngram_llm, prompts, params) == token_ids(llm, prompts, params)


@pytest.mark.parametrize("spec_llm", ["ngram_llm", "self_draft_llm"])
def test_seeded_sampling_with_speculation_is_reproducible(request, spec_llm, prompts):
    spec_llm = request.getfixturevalue(spec_llm)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = token_ids(spec_llm, prompts[:1], seeded)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=12), greedy()]
    mixed = token_ids(spec_llm, prompts, [seeded] + others)[0]
    assert mixed == alone
    assert token_ids(spec_llm, prompts[:1], SamplingParams(temperature=0.8, top_p=0.95, seed=12,
                                                           max_tokens=MAX_TOKENS, ignore_eos=True))[0] != alone


def test_preemption_with_draft_model_matches_plain_decoding(llm, model_path, prompts, reference):
    block_bytes = kv_bytes_per_block(llm.llm_engine.model_config, 16, llm.llm_engine.config.torch_dtype)
    tiny = LLM(model_path, kv_cache_memory=8 * block_bytes,
               speculative_config={"method": "draft_model", "model": model_path, "num_speculative_tokens": 3})
    assert token_ids(tiny, prompts, greedy()) == reference
    assert tiny.llm_engine.scheduler.num_preemptions > 0
    assert tiny.llm_engine.spec_decoding_stats.acceptance_rate == 1.0


def test_prometheus_counters_follow_the_engine_stats(ngram_llm, prompts):
    from prometheus_client import CollectorRegistry

    from inferno.engine.async_llm import SchedulerStats
    from inferno.server.metrics import PrometheusStatLogger
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger(registry, "m")
    engine = ngram_llm.llm_engine
    stats = engine.spec_decoding_stats
    for _ in range(2):  # counters advance by what the engine added since the last record
        token_ids(ngram_llm, prompts[:1], greedy())
        stat_logger.record(SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, spec_decoding_stats=stats), [], {})

    def sample(name: str, **labels) -> float:
        return registry.get_sample_value(f"inferno:spec_decode_{name}_total", {"model_name": "m", **labels})
    assert sample("num_draft_tokens") == stats.num_draft_tokens > 0
    assert sample("num_accepted_tokens") == stats.num_accepted_tokens > 0
    assert sample("num_drafts") == stats.num_drafts
    per_pos = [sample("num_accepted_tokens_per_pos", position=str(p)) for p in range(4)]
    assert per_pos == stats.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens


def test_speculation_with_prefix_cache_hits_and_n_samples(ngram_llm, prompts, reference):
    """Prompts served again start after their cached blocks, and n > 1 samples fork the prompt: every greedy sample
    is still plain decoding's output, drafts are accepted, and no block leaks."""
    engine = ngram_llm.llm_engine
    token_ids(ngram_llm, prompts, greedy())  # the prompts' full blocks enter the prefix cache
    hits, accepted = engine.kv_cache_manager.prefix_cache_hits, engine.spec_decoding_stats.num_accepted_tokens
    outputs = ngram_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n=2), use_tqdm=False)
    assert engine.kv_cache_manager.prefix_cache_hits > hits
    assert engine.spec_decoding_stats.num_accepted_tokens > accepted
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[r, r] for r in reference]
    assert_all_blocks_free(engine)
