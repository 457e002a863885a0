"""Sampling strategies: seeds, truncation sets, penalties, stops, logprobs, n > 1."""
import math

import pytest
import torch

from inferno import SamplingParams
from inferno.layers.sampler import Sampler, SamplingMetadata, apply_penalties

PROMPT = "Write a short story about a robot who learns to paint."


def chat(llm, text: str = PROMPT) -> dict:
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": text}])
    return {"prompt_token_ids": tok.encode(rendered, add_special_tokens=False)}


def tokens(llm, prompt, **params) -> list[int]:
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].token_ids


# seeds
def test_seeded_sampling_is_reproducible(llm):
    a = tokens(llm, chat(llm), temperature=1.0, seed=123, max_tokens=24)
    b = tokens(llm, chat(llm), temperature=1.0, seed=123, max_tokens=24)
    c = tokens(llm, chat(llm), temperature=1.0, seed=124, max_tokens=24)
    assert a == b
    assert a != c


def test_seeded_sampling_does_not_depend_on_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24)
    alone = llm.generate(chat(llm), params, use_tqdm=False)[0].outputs[0].token_ids
    others = [chat(llm, f"Tell me fact number {i} about the sea.") for i in range(5)]
    mixed = llm.generate(others[:3] + [chat(llm)] + others[3:],
                         [SamplingParams(temperature=1.0, max_tokens=30)] * 3 + [params] +
                         [SamplingParams(temperature=0.5, seed=i, max_tokens=10) for i in range(2)], use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone


# truncation: checked against the raw logprobs the engine reports (temperature 1, no penalties: same ranking)
def sampled_positions(llm, **params):
    out = llm.generate(chat(llm), SamplingParams(temperature=1.0, max_tokens=40, logprobs=20, **params),
                       use_tqdm=False)[0].outputs[0]
    return [(t, pos) for t, pos in zip(out.token_ids, out.logprobs)]


def test_top_k_never_samples_outside_k(llm):
    for token, pos in sampled_positions(llm, top_k=3, seed=1):
        assert pos[token].rank <= 3


def test_top_p_never_samples_outside_nucleus(llm):
    for token, pos in sampled_positions(llm, top_p=0.5, seed=2):
        rank = pos[token].rank
        above = sum(math.exp(lp.logprob) for t, lp in pos.items() if lp.rank < rank and t != token)
        assert above < 0.5 + 1e-4


def test_min_p_never_samples_below_threshold(llm):
    for token, pos in sampled_positions(llm, min_p=0.2, seed=3):
        top = max(lp.logprob for lp in pos.values())
        assert pos[token].logprob >= top + math.log(0.2) - 1e-4


def metadata(batch: int, **overrides) -> SamplingMetadata:
    fields = dict(temperature=torch.ones(batch), all_greedy=False, top_k=None, top_p=None, min_p=None,
                  generators={}, penalty_rows=[], repetition_penalty=None, presence_penalty=None,
                  frequency_penalty=None, prompt_tokens=[], output_token_ids=[], banned_token_ids={},
                  max_num_logprobs=None)
    fields.update(overrides)
    return SamplingMetadata(**fields)


def test_sampler_truncation_sets_on_synthetic_logits():
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    probs = logits.softmax(-1)
    order = probs.argsort(dim=-1, descending=True)
    rank = order.argsort(dim=-1)  # rank[i, t] = 0 for the most likely token
    k, p, m = torch.randint(1, 8, (64,)), torch.rand(64) * 0.9 + 0.05, torch.rand(64) * 0.5
    for _ in range(20):
        out = Sampler()(logits, metadata(64, top_k=k, top_p=p, min_p=m)).sampled_token_ids
        r = rank.gather(1, out[:, None]).squeeze(1)
        assert (r < k).all()
        sorted_probs = probs.gather(1, order)
        mass_above = (sorted_probs.cumsum(-1) - sorted_probs).gather(1, r[:, None]).squeeze(1)
        assert (mass_above < p + 1e-6).all()
        # min-p is applied after top-k/top-p renormalisation; the kept set still contains only tokens whose
        # probability is at least min_p times the best one
        assert (probs.gather(1, out[:, None]).squeeze(1) >= m * probs.max(-1).values - 1e-6).all()


def test_penalties_match_reference_formula():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    prompts, outputs = [[1, 2, 3], [4], [5, 5]], [[3, 3, 7], [], [5, 9, 9, 9]]
    rep, pres, freq = torch.tensor([1.3, 1.0, 0.8]), torch.tensor([0.5, 0.0, -0.3]), torch.tensor([0.2, 0.0, 1.0])
    md = metadata(3, penalty_rows=[0, 1, 2], repetition_penalty=rep, presence_penalty=pres,
                  frequency_penalty=freq, prompt_tokens=[torch.tensor(p).unique() for p in prompts],
                  output_token_ids=outputs)
    ours = apply_penalties(logits.clone(), md)
    ref = logits.clone()
    for i in range(3):
        for t in set(prompts[i]) | set(outputs[i]):
            ref[i, t] = ref[i, t] / rep[i] if ref[i, t] > 0 else ref[i, t] * rep[i]
        for t in set(outputs[i]):
            ref[i, t] -= freq[i] * outputs[i].count(t) + pres[i]
    assert torch.allclose(ours, ref)


def test_repetition_penalty_changes_greedy_output(llm):
    plain = tokens(llm, chat(llm), temperature=0, max_tokens=40)
    penalised = tokens(llm, chat(llm), temperature=0, max_tokens=40, repetition_penalty=1.5)
    assert plain != penalised
    assert len(set(penalised)) >= len(set(plain))


# stops and lengths
def test_stop_string_spanning_two_tokens_is_excluded(llm):
    tok = llm.get_tokenizer()
    reference = llm.generate(chat(llm), SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    pieces = [tok.decode(reference.token_ids[:i]) for i in range(len(reference.token_ids) + 1)]
    i = next(i for i in range(5, len(pieces) - 1)
             if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][len(pieces[i]):][:2]  # the end of one token + the start of the next
    assert stop in reference.text
    out = llm.generate(chat(llm), SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert stop not in out.text
    assert out.text == reference.text[:reference.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    with_stop = llm.generate(chat(llm), SamplingParams(temperature=0, max_tokens=40, stop=stop,
                                                       include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert with_stop.text == reference.text[:reference.text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    reference = tokens(llm, chat(llm), temperature=0, max_tokens=20)
    stop_token = reference[6]
    out = llm.generate(chat(llm), SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[:reference.index(stop_token) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    short = llm.generate(chat(llm), SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert short.token_ids == reference[:5] and short.finish_reason == "length"


def test_min_tokens_defers_stop_tokens(llm):
    first = tokens(llm, chat(llm), temperature=0, max_tokens=1)[0]
    out = tokens(llm, chat(llm), temperature=0, max_tokens=10, min_tokens=3, stop_token_ids=[first])
    assert len(out) >= 3 and first not in out[:3]


def test_eos_ignore_eos_and_special_tokens(llm):
    prompt = chat(llm, "Reply with just the word: yes")
    ended = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50), use_tqdm=False)[0].outputs[0]
    assert ended.finish_reason == "stop" and ended.token_ids[-1] in llm.get_tokenizer().eos_token_ids
    assert "<|im_end|>" not in ended.text
    n = len(ended.token_ids) + 5
    params = dict(temperature=0, max_tokens=n, ignore_eos=True)
    hidden = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    shown = llm.generate(prompt, SamplingParams(**params, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert len(hidden.token_ids) == n and hidden.finish_reason == "length"
    assert "<|im_end|>" in shown.text and "<|im_end|>" not in hidden.text


# n > 1 and logprobs
def test_n_samples(llm):
    out = llm.generate(chat(llm), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = llm.generate(chat(llm), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_logprobs_match_hf(llm, hf_model):
    prompt = chat(llm)
    ids = prompt["prompt_token_ids"]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=5, prompt_logprobs=2),
                       use_tqdm=False)[0]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids + out.outputs[0].token_ids])).logits[0].log_softmax(-1)
    for step, (token, pos) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = ref[len(ids) - 1 + step]
        assert pos[token].rank == 1  # greedy picks the top token
        top5 = row.topk(5)
        assert set(pos) == set(top5.indices.tolist())
        for t, lp in pos.items():
            assert abs(lp.logprob - row[t].item()) < 1e-3
            assert lp.decoded_token == llm.get_tokenizer().id_to_token(t)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        pos = out.prompt_logprobs[p]
        assert abs(pos[ids[p]].logprob - ref[p - 1, ids[p]].item()) < 1e-3
        assert len(pos) <= 3
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(pos[t].logprob for t, pos in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)))
