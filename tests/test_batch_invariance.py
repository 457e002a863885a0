"""On the default path (the GGUF file's blocks with int8 activations, a float16 KV cache) a greedy request gets the
same tokens and the same log-probabilities, to the bit, alone or batched with others: whether it runs in the
runner's first pass, how the shared token budget chunks its prompt, how many sequences share the decode
attention's threads. (tests/test_batching.py shows the same tokens for the float32 model.)"""
import pytest

from conftest import assert_all_blocks_free
from inferno import LLM, SamplingParams

BUDGET = 192  # tokens per step: the long prompt is chunked, at other places alone than batched
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def native_llm():
    return LLM(kv_cache_memory=64 << 20, max_num_batched_tokens=BUDGET)


@pytest.fixture(scope="module")
def prompts(native_llm) -> list[list[int]]:
    tok = native_llm.get_tokenizer()
    story = tok.encode("A long time ago, in a small village by the sea, there lived an old fisherman who told "
                       "stories about the storms he had seen, the fish he had caught and the friends he had lost. ")
    code = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + ")
    # the long one: past the budget, and long enough that its decode attention is split over threads when alone
    return [story[:23], code, (story * 9)[:300], story[5:50] + code[:11]]


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each prompt's tokens and, per position, its two best log-probabilities."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert_all_blocks_free(llm.llm_engine)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in position.items()}
                                      for position in o.outputs[0].logprobs]) for o in outs]


@pytest.fixture(scope="module")
def alone(native_llm, prompts):
    """The first prompt alone is the runner's first pass."""
    return [generate(native_llm, [p])[0] for p in prompts]


def test_prompts_are_long_enough_to_be_chunked_and_split(prompts):
    assert len(prompts[2]) > BUDGET and len(prompts[2]) >= 256  # 256: two splits of 128 keys


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [1, 2]])
def test_a_batch_gives_each_prompt_what_it_gets_alone(native_llm, prompts, alone, order):
    batched = generate(native_llm, [prompts[i] for i in order])
    for i, result in zip(order, batched):
        assert result == alone[i], f"prompt {i}"
