"""Speculative decoding in the batched engine: the output is the target's, whatever the proposer; no block leaks."""
import time

import pytest

from conftest import FLOAT32, assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.request import Request, RequestStatus
from inferno.spec_decode.metrics import SpecDecodingStats
from inferno.spec_decode.policy import PROBE_INTERVAL, SpeculationPolicy
from inferno.speculative_config import SpeculativeConfig
from inferno.worker.model_runner import kv_bytes_per_block
from test_model_vs_hf import write_tiny_hf_model

MAX_TOKENS = 16
# speculation stays on in batches of any size here (the batch switch has its own test)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": None}


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
    return LLM(model_path, kv_cache_memory=64 << 20, speculative_config=NGRAM, **FLOAT32)


@pytest.fixture(scope="module")
def self_draft_llm(model_path) -> LLM:
    """The default model as its own draft: every proposal must be accepted."""
    return LLM(model_path, kv_cache_memory=64 << 20, **FLOAT32,
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


@pytest.mark.parametrize("spec_llm", ["ngram_llm", "self_draft_llm"])
def test_penalties_and_min_tokens_see_the_drafts_before_each_position(request, llm, spec_llm, prompts):
    params = greedy(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, min_tokens=5,
                    ignore_eos=False, max_tokens=16)
    assert token_ids(request.getfixturevalue(spec_llm), prompts, params) == token_ids(llm, prompts, params)


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
    block_bytes = kv_bytes_per_block(llm.llm_engine.model_config, 16, llm.llm_engine.config.kv_cache_dtype)
    tiny = LLM(model_path, kv_cache_memory=16 * block_bytes, **FLOAT32,  # 8 blocks: the draft's cache takes half
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
    assert sample("num_paused_proposals") == stats.num_paused_proposals
    assert sample("num_disabled_steps") == stats.num_disabled_steps


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


# when to speculate: disable_by_batch_size and the per-request acceptance policy

def record_schedules(engine) -> list:
    """Every SchedulerOutput the engine runs from now on."""
    seen, schedule = [], engine.scheduler.schedule

    def recording():
        seen.append(schedule())
        return seen[-1]
    engine.scheduler.schedule = recording
    return seen


def test_disable_by_batch_size_switches_speculation_off_in_large_batches(model_path, prompts, reference):
    spec_llm = LLM(model_path, kv_cache_memory=64 << 20, **FLOAT32,
                   speculative_config={**NGRAM, "disable_by_batch_size": 2, "draft_acceptance_threshold": 0})
    schedules = record_schedules(spec_llm.llm_engine)
    # the requests end one after the other: the last one runs alone for its final 8 tokens
    lengths = [4, 8, MAX_TOKENS]
    outputs = token_ids(spec_llm, prompts, [greedy(max_tokens=n) for n in lengths])
    assert outputs == [ref[:n] for ref, n in zip(reference, lengths)]
    assert all(not s.spec_token_ids for s in schedules if len(s.num_scheduled_tokens) >= 2)
    assert any(s.spec_token_ids for s in schedules if len(s.num_scheduled_tokens) == 1)
    assert spec_llm.llm_engine.spec_decoding_stats.num_disabled_steps > 0


def running_request(request_id: str, max_tokens: int = 100) -> Request:
    req = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens), set(), 1000)
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, req.num_tokens - 1
    return req


def test_policy_pauses_low_acceptance_requests_probes_them_and_resumes():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                          "draft_acceptance_threshold": 0.3})
    stats = SpecDecodingStats(4)
    policy = SpeculationPolicy(config, stats)
    good, bad = running_request("good"), running_request("bad")
    assert policy.plan([good, bad]) == [(good, 4), (bad, 4)]  # a new request speculates fully
    bad_counts = []
    while not bad_counts or bad_counts[-1] > 0:  # "bad" never gets a draft accepted, "good" always all of them
        assert len(bad_counts) < 10, "the policy never paused a request whose drafts are all rejected"
        policy.observe("good", 4, 4)
        policy.observe("bad", 4, 0)
        planned = dict((r.request_id, k) for r, k in policy.plan([good, bad]))
        assert planned["good"] == 4
        bad_counts.append(planned.get("bad", 0))
    assert bad_counts == sorted(bad_counts, reverse=True) and len(bad_counts) > 1
    # paused from there: no drafts for PROBE_INTERVAL - 1 steps in all, then a probe with one draft
    paused = [dict((r.request_id, k) for r, k in policy.plan([good, bad])).get("bad", 0)
              for _ in range(PROBE_INTERVAL - 1)]
    assert paused == [0] * (PROBE_INTERVAL - 2) + [1]
    assert stats.num_paused_proposals == PROBE_INTERVAL - 1
    for _ in range(4):  # the probes are accepted again: back to full speculation
        policy.observe("bad", 1, 1)
    assert dict((r.request_id, k) for r, k in policy.plan([good, bad]))["bad"] == 4
    # never past max_tokens, and finished requests are forgotten
    short = running_request("short", max_tokens=2)
    assert policy.plan([short]) == [(short, 1)]
    assert set(policy.acceptance) <= {"short"}


def test_threshold_zero_always_proposes_full_drafts():
    policy = SpeculationPolicy(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                                            "draft_acceptance_threshold": 0}), SpecDecodingStats(3))
    req = running_request("r")
    for _ in range(5):
        policy.observe("r", 3, 0)
    assert policy.plan([req]) == [(req, 3)]


@pytest.fixture(scope="module")
def random_draft(llm, tmp_path_factory) -> str:
    """A tiny random model with the default model's tokenizer: its drafts are almost never accepted."""
    folder = tmp_path_factory.mktemp("random_draft")
    write_tiny_hf_model(folder, llm.get_tokenizer(), "llama")
    return str(folder)


def count_calls(obj, name: str) -> list[int]:
    calls, method = [0], getattr(obj, name)

    def counting(*args, **kwargs):
        calls[0] += 1
        return method(*args, **kwargs)
    setattr(obj, name, counting)
    return calls


def test_low_acceptance_draft_stops_proposing_and_output_is_unchanged(model_path, random_draft, prompts, reference):
    """With a draft that is always wrong, the policy stops running it after a few steps (fewer draft passes and
    verified drafts than with the policy off); greedy output stays plain decoding's."""
    results = {}
    for threshold in (0.0, 0.3):
        spec_llm = LLM(model_path, kv_cache_memory=64 << 20, **FLOAT32,
                       speculative_config={"method": "draft_model", "model": random_draft, "num_speculative_tokens": 3,
                                           "draft_acceptance_threshold": threshold})
        engine = spec_llm.llm_engine
        draft_passes = count_calls(engine.executor.worker.proposer.runner, "forward")
        assert token_ids(spec_llm, prompts, greedy()) == reference
        results[threshold] = (draft_passes[0], engine.spec_decoding_stats)
    (passes_off, off), (passes_on, on) = results[0.0], results[0.3]
    assert off.acceptance_rate < 0.2 and off.num_paused_proposals == 0
    assert on.num_paused_proposals > 0
    assert on.num_draft_tokens < off.num_draft_tokens / 2
    assert passes_on < passes_off / 2


def cache_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for attn in model.attention_layers for t in (attn.k_cache, attn.v_cache))


@pytest.mark.parametrize("draft", ["itself", "random"])
def test_draft_model_kv_cache_shares_kv_cache_memory(model_path, random_draft, draft):
    """The draft's KV cache is part of kv_cache_memory: both caches together fit in it, with one block id space
    split by the two models' KV bytes per block (the default model as its own draft: half the plain blocks)."""
    budget = 8 << 20
    plain = LLM(model_path, kv_cache_memory=budget).llm_engine
    target_block = cache_bytes(plain.model_runner.model) // plain.num_blocks
    assert plain.num_blocks == budget // target_block
    spec_llm = LLM(model_path, kv_cache_memory=budget, speculative_config={
        "method": "draft_model", "model": model_path if draft == "itself" else random_draft,
        "num_speculative_tokens": 3})
    engine = spec_llm.llm_engine
    draft_runner = engine.executor.worker.proposer.runner
    target_bytes, draft_bytes = cache_bytes(engine.model_runner.model), cache_bytes(draft_runner.model)
    assert draft_runner.num_blocks == engine.num_blocks
    assert target_bytes == engine.num_blocks * target_block
    assert target_bytes + draft_bytes <= budget
    assert engine.num_blocks == budget // (target_block + draft_bytes // engine.num_blocks)
    if draft == "itself":
        assert draft_bytes == target_bytes and engine.num_blocks == budget // (2 * target_block) < plain.num_blocks


def test_token_times_include_the_proposal_made_before_the_step_returns(self_draft_llm, prompts, monkeypatch):
    """A step hands its tokens out after proposing the next drafts (the draft model's prefill of a new prompt
    included): a token's time is when the step returns, and each request's times are in order."""
    proposer = self_draft_llm.llm_engine.executor.worker.proposer
    propose, delay = proposer.propose, 0.3

    def slow_propose(requests):
        drafts = propose(requests)
        time.sleep(delay)
        return drafts
    monkeypatch.setattr(proposer, "propose", slow_propose)
    outputs = self_draft_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    for out in outputs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.first_token_time - m.first_scheduled_time >= delay
    assert_all_blocks_free(self_draft_llm.llm_engine)
