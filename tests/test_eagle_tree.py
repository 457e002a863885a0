"""EAGLE heads drafting token trees: the head's tree passes against a dense forward of each path, and speculation
with a tree (the output is the target's)."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from conftest import FLOAT32, assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.loader.eagle_folder import read_eagle_folder
from inferno.loader.safetensors import read_config
from inferno.worker.model_runner import kv_bytes_per_block
from inferno.worker.request_state import CachedRequestState
from inferno.worker.spec_decode.drafting_request import DraftingRequest
from inferno.worker.spec_decode.eagle import EagleProposer, build_eagle_head
from inferno.worker.spec_decode.eagle_tree import HeadTree
from inferno.worker.spec_decode.target_hidden import TargetHiddenStates
from test_eagle import K, eagle, hf_layer, random_head_tensors, smol_head, write_layout  # noqa: F401 (fixture)
from test_spec_decode import MAX_TOKENS, greedy, prompts, reference, token_ids  # noqa: F401 (fixtures)
from test_spec_heads import TOKEN_TREE, cycle_model, record_trees  # noqa: F401 (fixture)

TREE_K = len(max(TOKEN_TREE, key=len))  # the whole tree drafted: 7 nodes, 3 inner ones, 3 deep


def test_a_tree_is_cut_to_its_depth_and_to_the_slots_for_its_inner_nodes():
    whole = HeadTree.cut(TOKEN_TREE, 3, 3)
    assert whole.paths == tuple(TOKEN_TREE) and whole.passes == (1, 2, 4)
    assert [whole.rank(node) for node in range(1, 8)] == [0, 1, 2, 0, 1, 0, 0]
    # (0,)'s pass in the slot after the root's, (1,)'s next, (0, 0)'s after: (0, 0) must not see (1,)'s
    assert [whole.pass_slot(node, 10) for node in whole.passes] == [11, 12, 13]
    assert whole.hidden_slots(4, 10) == [12] and whole.hidden_slots(2, 10) == [11]
    two_deep = HeadTree.cut(TOKEN_TREE, 2, 3)
    assert two_deep.paths == tuple(TOKEN_TREE[:6]) and two_deep.passes == (1, 2)
    one_slot = HeadTree.cut(TOKEN_TREE, 3, 1)  # (1,) and (0, 0) get no pass: their children go
    assert one_slot.paths == ((0,), (1,), (2,), (0, 0), (0, 1)) and one_slot.passes == (1,)
    assert HeadTree.cut(TOKEN_TREE, 3, 0).paths == ((0,), (1,), (2,))


# the head's tree passes against a dense forward of every path (a head of head size 16: the native kernel's)

HIDDEN, VOCAB = 64, 90


@pytest.fixture(scope="module")
def tree_head(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle_tree")
    from transformers import LlamaConfig
    LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                max_position_embeddings=256).save_pretrained(folder / "target")
    torch.manual_seed(0)
    config, layer = hf_layer(HIDDEN, 96, 4, 2, VOCAB)
    write_layout(folder / "head", "vllm", random_head_tensors(layer, HIDDEN, VOCAB, True, False), config)
    return build_eagle_head(read_eagle_folder(folder / "head"), read_config(folder / "target"))


def tree_proposer(head, backend: str) -> EagleProposer:
    """The proposer over a stand-in target: an embedding and an LM head (the head reads nothing else of it)."""
    target = SimpleNamespace(config=SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB),
                             embed_tokens=torch.nn.Embedding(VOCAB, HIDDEN), norm=torch.nn.Identity(),
                             lm_head=torch.nn.Linear(HIDDEN, VOCAB, bias=False))
    runner = SimpleNamespace(model=target, device=torch.device("cpu"), dtype=torch.float32, num_blocks=4,
                             requests={}, tile_switch=SimpleNamespace(step=contextlib.nullcontext))
    return EagleProposer(head, runner, SimpleNamespace(block_size=16, attention_backend=backend), TOKEN_TREE)


@pytest.mark.parametrize("backend", ["torch", "cpu_kernel"])
def test_each_tree_node_s_head_output_matches_a_dense_forward_of_its_path(tree_head, backend):
    torch.manual_seed(1)
    proposer = tree_proposer(tree_head, backend)
    target = proposer.target
    n = 21  # the head's root at position 19: its passes cross into the second block
    tokens = torch.randint(VOCAB, (n,)).tolist()
    features = torch.randn(n - 1, HIDDEN)
    state = CachedRequestState("r", tokens, list(tokens), SamplingParams(temperature=0), set(), [2, 0, 3], n - 1, None, 0)
    proposer.runner.requests = {"r": state}
    proposer.runner.target_hidden = TargetHiddenStates()
    proposer.runner.target_hidden.record("r", 0, features)
    drafted = []
    draft_trees = proposer.draft_trees
    proposer.draft_trees = lambda *args: drafted.append(draft_trees(*args)) or drafted[-1]
    out = proposer.propose([DraftingRequest(state, list(tokens), TREE_K, 0, tree=True)])
    assert out.spec_tree_parents["r"] == [0, 0, 0, 1, 1, 2, 4] and not out.draft_probs
    drafts, outputs = out.spec_token_ids["r"], drafted[0][0]
    assert sorted(outputs) == [0, 1, 2, 4]  # the root and the inner nodes

    def dense(path: tuple[int, ...]) -> torch.Tensor:
        """The head's output at the path's last token, the head run densely over the context and the path, each
        step's feature its own output at the step before."""
        feats = [features] + [dense(path[:i])[None] for i in range(len(path))]
        with torch.no_grad():
            embeds = target.embed_tokens(torch.tensor(tokens[1:] + list(path)))
            return tree_head.forward_dense(embeds[None], torch.cat(feats)[None])[0, -1]

    node_paths = {0: ()}
    for node, parent in enumerate(out.spec_tree_parents["r"], start=1):
        node_paths[node] = node_paths[parent] + (drafts[node - 1],)
    for node, output in outputs.items():
        torch.testing.assert_close(output, dense(node_paths[node]), rtol=1e-4, atol=1e-4)
    for node, path in zip(range(1, 8), TOKEN_TREE):  # each draft: its rank in its parent's dense logits
        logits = tree_head.logits(dense(node_paths[out.spec_tree_parents["r"][node - 1]]), target.lm_head)
        assert drafts[node - 1] == logits.topk(3).indices[path[-1]].item()


# speculation with a tree on the default model (a random head: drafts accepted now and then)

@pytest.fixture(scope="module")
def eagle_tree_llm(model_path, smol_head) -> LLM:
    return LLM(model_path, kv_cache_memory=64 << 20, **FLOAT32,
               speculative_config=eagle(smol_head, speculative_token_tree=TOKEN_TREE))


def test_greedy_with_an_eagle_tree_matches_plain_decoding_alone_and_in_batch(eagle_tree_llm, prompts, reference):
    """Alone and two at a time every request verifies trees; three at a time, chains until one finishes."""
    trees = record_trees(eagle_tree_llm)
    stats = eagle_tree_llm.llm_engine.spec_decoding_stats
    assert token_ids(eagle_tree_llm, prompts[:1], greedy()) == reference[:1]
    assert token_ids(eagle_tree_llm, prompts[:2], greedy()) == reference[:2]
    assert 2 in trees and stats.num_accepted_tokens > 0
    trees.clear()
    assert token_ids(eagle_tree_llm, prompts, greedy()) == reference
    assert trees[0] == 0  # a busy batch verifies chains
    assert_all_blocks_free(eagle_tree_llm.llm_engine)


def test_eagle_tree_with_chunked_prefill_and_preemption_matches_plain_decoding(llm, model_path, smol_head, prompts,
                                                                               reference):
    block_bytes = kv_bytes_per_block(llm.llm_engine.model_config, 16, llm.llm_engine.config.kv_cache_dtype)
    cramped = LLM(model_path, kv_cache_memory=11 * block_bytes, max_num_batched_tokens=32, **FLOAT32,
                  speculative_config=eagle(smol_head, speculative_token_tree=TOKEN_TREE))
    trees = record_trees(cramped)
    assert token_ids(cramped, prompts, greedy()) == reference
    assert cramped.llm_engine.scheduler.num_preemptions > 0 and max(trees) > 0
    assert_all_blocks_free(cramped.llm_engine)


def test_seeded_sampling_with_an_eagle_tree_is_reproducible(eagle_tree_llm, prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = token_ids(eagle_tree_llm, prompts[:1], seeded)
    assert token_ids(eagle_tree_llm, prompts[:1], seeded) == first


def test_a_tree_naming_ranks_past_the_vocabulary_is_refused(model_path, smol_head):
    with pytest.raises(ValueError, match="names rank 100000"):
        LLM(model_path, kv_cache_memory=16 << 20, **FLOAT32,
            speculative_config=eagle(smol_head, speculative_token_tree=[(0,), (100000,)]))
