"""Automatic prefix caching: same outputs as without it, only new tokens computed, blocks shared and reclaimed."""
import pytest
import torch

from conftest import FLOAT32, assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.core.kv_blocks import BlockHash, hash_block
from inferno.engine.block_pool import BlockPool
from inferno.worker.model_runner import kv_bytes_per_block

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def shared_prefix_prompts(llm) -> list[list[int]]:
    """Chat-like prompts: a long common system prompt plus different, growing histories."""
    tok = llm.get_tokenizer()
    system = tok.encode("You are a careful assistant for a small bookshop. Answer questions about opening hours, "
                        "orders and book recommendations politely and briefly. " * 2)
    turns = [tok.encode(f" Customer {i}: do you have any books about {topic}?")
             for i, topic in enumerate(["sailing", "birds", "the history of Rome", "gardening", "chess"])]
    return [system + sum(turns[:i + 1], []) for i in range(5)] + [system[:37], system[:48] + turns[2]]


def generate(llm: LLM, prompts: list[list[int]], **params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params), use_tqdm=False)
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def uncached(model_path, shared_prefix_prompts) -> dict[str, list[list[int]]]:
    llm = LLM(model_path, enable_prefix_caching=False, kv_cache_memory=256 << 20, **FLOAT32)
    return {"greedy": [generate(llm, [p], temperature=0)[0] for p in shared_prefix_prompts],
            "seeded": [generate(llm, [p], temperature=0.9, top_p=0.9, seed=7)[0] for p in shared_prefix_prompts]}


@pytest.mark.parametrize("chunk", [None, 24])  # 24: hits end inside what would have been a prefill chunk
def test_outputs_equal_with_and_without_prefix_caching(llm, model_path, shared_prefix_prompts, uncached, chunk):
    if chunk is not None:
        llm = LLM(model_path, max_num_batched_tokens=chunk, kv_cache_memory=256 << 20, **FLOAT32)
    for kind, params in [("greedy", dict(temperature=0)), ("seeded", dict(temperature=0.9, top_p=0.9, seed=7))]:
        one_by_one = [generate(llm, [p], **params)[0] for p in shared_prefix_prompts]  # each hits the earlier ones
        assert one_by_one == uncached[kind]
        assert generate(llm, shared_prefix_prompts, **params) == uncached[kind]  # all cached now
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits > 0
    assert_all_blocks_free(llm.llm_engine)


def test_eviction_then_recompute_gives_same_outputs(model_path, llm, shared_prefix_prompts, uncached):
    block_bytes = kv_bytes_per_block(llm.llm_engine.model_config, 16, llm.llm_engine.config.kv_cache_dtype)
    llm = LLM(model_path, kv_cache_memory=12 * block_bytes, **FLOAT32)  # room for one prompt at a time: caches get evicted
    pool = llm.llm_engine.kv_cache_manager.block_pool
    outputs, evicted = [], False
    for p in shared_prefix_prompts + shared_prefix_prompts[:2]:
        before = dict(pool.cached_blocks)
        outputs += generate(llm, [p], temperature=0)
        evicted |= any(pool.cached_blocks.get(h) != b for h, b in before.items())
    assert evicted
    assert outputs == uncached["greedy"] + uncached["greedy"][:2]
    assert_all_blocks_free(llm.llm_engine)


def test_second_request_computes_only_new_tokens(llm):
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    tok = llm.get_tokenizer()
    prefix = (tok.encode("A shared system prompt about the weather, the sea and the mountains. ") * 70)[:1000]
    first, second = prefix + tok.encode(" First question?"), prefix + tok.encode(" A different second question?")
    scheduler, kv = engine.scheduler, engine.kv_cache_manager
    for i, prompt in enumerate([first, second]):
        computed, hits, queries = scheduler.num_computed_prompt_tokens, kv.prefix_cache_hits, kv.prefix_cache_queries
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
        assert kv.prefix_cache_queries - queries == len(prompt)
    hit = 1000 // 16 * 16  # every full block of the shared prefix
    assert kv.prefix_cache_hits - hits == hit
    assert scheduler.num_computed_prompt_tokens - computed == len(second) - hit
    assert kv.block_pool.num_cached_blocks >= len(first) // 16


def test_n4_counts_prompt_blocks_once(llm):
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    ids = (llm.get_tokenizer().encode("Tell me about the tides and the moon. ") * 20)[:97]  # 96 = 6 full blocks
    computed = engine.scheduler.num_computed_prompt_tokens
    engine.add_request("n4", {"prompt_token_ids": ids}, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10,
                                                                       ignore_eos=True))
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(engine.num_blocks - engine.num_free_blocks)
    # 6 shared prompt blocks + one block per sample for position 96 onwards (at most 107 < 112)
    assert max(used) == 6 + 4
    assert engine.scheduler.num_computed_prompt_tokens - computed == 97 + 3  # the others compute the last token
    assert_all_blocks_free(engine)
    # the freed blocks are cached and reusable: the same prompt again computes one block's worth at most
    computed = engine.scheduler.num_computed_prompt_tokens
    engine.add_request("again", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_computed_prompt_tokens - computed == 1
    assert_all_blocks_free(engine)


def test_n4_samples_equal_without_sharing(model_path, llm):
    params = dict(n=4, temperature=1.0, seed=11)
    prompt = llm.get_tokenizer().encode("Write a short poem about autumn leaves falling. " * 3)
    unshared = LLM(model_path, enable_prefix_caching=False, kv_cache_memory=64 << 20, **FLOAT32)
    # the reference: each sample computed alone from scratch, with its own seed
    alone = [generate(unshared, [prompt], **dict(params, n=1, seed=11 + i))[0] for i in range(4)]
    assert generate(llm, [prompt], **params) == alone
    assert generate(unshared, [prompt], **params) == alone  # forking works without the prefix cache too


def test_reset_prefix_cache(llm):
    engine = llm.llm_engine
    generate(llm, [list(range(100, 164))], temperature=0)
    assert engine.kv_cache_manager.block_pool.num_cached_blocks > 0
    assert engine.reset_prefix_cache() > 0
    assert engine.kv_cache_manager.block_pool.num_cached_blocks == 0
    hits = engine.kv_cache_manager.prefix_cache_hits
    generate(llm, [list(range(100, 164))], temperature=0)
    assert engine.kv_cache_manager.prefix_cache_hits == hits


def test_prompt_logprobs_requests_do_not_use_the_cache(llm):
    prompt = list(range(300, 360))
    generate(llm, [prompt], temperature=0)
    hits = llm.llm_engine.kv_cache_manager.prefix_cache_hits
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    assert len(out.prompt_logprobs) == len(prompt)
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits == hits


def test_block_hash_compares_tokens_exactly():
    pool = BlockPool(4)
    real = hash_block(None, list(range(16)))
    (block,) = pool.allocate(1)
    pool.cache(block, real)
    assert pool.lookup(real) == block
    forged = BlockHash(real.digest, tuple(range(1, 17)))  # same digest, other tokens: must not hit
    assert pool.lookup(forged) is None
    assert hash_block(real, [1] * 16) != hash_block(hash_block(None, [0] * 16), [1] * 16)  # the parent matters


def test_lru_eviction_order():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block, tokens in [(a, [1]), (b, [2]), (c, [3])]:
        pool.cache(block, hash_block(None, tokens))
    pool.free([a])
    pool.free([c, b])  # a sequence's tail (b) goes first: b is older than c now
    pool.touch([c])  # a hit takes c back out of the free queue
    assert pool.num_free_blocks == 2
    assert pool.allocate(1) == [a]  # least recently freed first, losing its hash
    assert pool.lookup(hash_block(None, [1])) is None and pool.lookup(hash_block(None, [2])) == b
    assert pool.allocate(1) == [b]
    assert pool.lookup(hash_block(None, [3])) == c
