"""EAGLE heads drafting token trees: the head's tree passes against a dense forward of each path, and speculation
with a tree (the output is the target's; under chunked prefill and preemption, Medusa's tree too)."""
from types import SimpleNamespace

import pytest
import torch

from conftest import FLOAT32, assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.loader.eagle_folder import read_eagle_folder
from inferno.loader.safetensors import read_config
from inferno.speculative_config import SpeculativeConfig
from inferno.worker.model_runner import kv_bytes_per_block
from inferno.worker.request_state import CachedRequestState
from inferno.worker.spec_decode.drafting_request import DraftingRequest
from inferno.worker.spec_decode.eagle import EagleProposer, build_eagle_head
from inferno.worker.spec_decode.eagle_tree import DynamicTree, StaticTree
from inferno.worker.spec_decode.target_hidden import TargetHiddenStates
from test_eagle import (eagle, hf_layer, random_head_tensors, smol_head, smol_head_draft,  # noqa: F401 (fixtures)
                        smol_head_whole, write_layout)
from test_spec_decode import MAX_TOKENS, greedy, prompts, reference, token_ids  # noqa: F401 (fixtures)
from test_spec_heads import TOKEN_TREE, medusa, record_trees, smol_heads  # noqa: F401 (fixture)

TREE_K = len(max(TOKEN_TREE, key=len))  # the whole tree drafted: 7 nodes, 3 inner ones, 3 deep


DYNAMIC = {"speculative_token_tree": "dynamic", "eagle_topk": 2, "num_draft_tokens": 6}


def test_a_static_tree_is_cut_to_its_depth_and_to_the_slots_for_its_inner_nodes():
    whole = StaticTree(TOKEN_TREE, 3, 3)
    assert whole.drafts()[1] == [0, 0, 0, 1, 1, 2, 4] and whole.ranks[1:] == [0, 1, 2, 0, 1, 0, 0]
    assert [whole.expand(), whole.expand(), whole.expand()] == [[1, 2], [4], []]
    # (0,)'s pass in the slot after the root's, (1,)'s next, (0, 0)'s after: (0, 0) must not see (1,)'s
    assert [whole.pass_slot(node, 10) for node in whole.passes] == [11, 12, 13]
    assert whole.hidden_slots(4, 10) == [12] and whole.hidden_slots(2, 10) == [11]
    assert StaticTree(TOKEN_TREE, 2, 3).drafts()[1] == [0, 0, 0, 1, 1, 2]
    one_slot = StaticTree(TOKEN_TREE, 3, 1)  # (1,) and (0, 0) get no pass: their children go
    assert one_slot.drafts()[1] == [0, 0, 0, 1, 1] and one_slot.ranks[1:] == [0, 1, 2, 0, 1]
    assert StaticTree(TOKEN_TREE, 3, 0).drafts()[1] == [0, 0, 0]


def test_a_dynamic_tree_expands_the_best_nodes_of_each_depth_and_keeps_the_best_of_all():
    tree = DynamicTree(topk=2, num_drafts=4, depth=3)
    tree.grow(0, [10, 11], [-0.1, -1.0])  # nodes 1, 2
    assert tree.expand() == [1, 2]
    tree.grow(1, [20, 21], [-0.2, -3.0])  # 3: -0.3, 4: -3.1
    tree.grow(2, [30, 31], [-0.05, -0.5])  # 5: -1.05, 6: -1.5
    assert tree.expand() == [3, 5]
    assert tree.hidden_slots(5, 10) == [11, 13]  # (10, 20)'s passes: not 5's ancestors
    tree.grow(3, [40, 41], [-0.1, -2.0])  # 7: -0.4, 8: -2.3
    tree.grow(5, [50, 51], [-0.01, -4.0])  # 9: -1.06, 10: -5.05
    assert tree.expand() == []  # three deep
    assert tree.drafts() == ([10, 11, 20, 40], [0, 0, 1, 3])  # nodes 1, 2, 3, 7: the best four, parents first


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


def tree_proposer(head, backend: str, tree: dict) -> EagleProposer:
    """The proposer over a stand-in target: an embedding and an LM head (the head reads nothing else of it)."""
    target = SimpleNamespace(config=SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB),
                             embed_tokens=torch.nn.Embedding(VOCAB, HIDDEN), norm=torch.nn.Identity(),
                             lm_head=torch.nn.Linear(HIDDEN, VOCAB, bias=False))
    runner = SimpleNamespace(model=target, device=torch.device("cpu"), dtype=torch.float32, num_blocks=4,
                             requests={})
    spec = SpeculativeConfig.from_dict(eagle("head", num_speculative_tokens=TREE_K, **tree))
    return EagleProposer(head, runner, SimpleNamespace(block_size=16, attention_backend=backend,
                                                       speculative_config=spec))


@pytest.mark.parametrize("tree", [{"speculative_token_tree": TOKEN_TREE}, DYNAMIC], ids=["static", "dynamic"])
@pytest.mark.parametrize("backend", ["torch", "cpu_kernel"])
def test_each_tree_node_s_head_output_matches_a_dense_forward_of_its_path(tree_head, backend, tree, monkeypatch):
    torch.manual_seed(1)
    proposer, dynamic = tree_proposer(tree_head, backend, tree), tree == DYNAMIC
    target = proposer.target
    n = 21  # the head's root at position 19: its passes cross into the second block
    tokens = torch.randint(VOCAB, (n,)).tolist()
    features = torch.randn(n - 1, HIDDEN)
    state = CachedRequestState("r", tokens, list(tokens), SamplingParams(temperature=0), set(), [2, 0, 3], n - 1,
                               None, 0)
    proposer.runner.requests = {"r": state}
    proposer.runner.target_hidden = TargetHiddenStates()
    proposer.runner.target_hidden.record("r", 0, features)
    drafted, outputs = [], []  # the tree; the head outputs that ranked children: the root's, then each pass's
    make_tree, logits = proposer._tree, tree_head.logits
    with monkeypatch.context() as spy:
        spy.setattr(proposer, "_tree", lambda *args: drafted.append(make_tree(*args)) or drafted[-1])
        spy.setattr(tree_head, "logits", lambda last, lm_head: outputs.extend(last) or logits(last, lm_head))
        out = proposer.propose([DraftingRequest(state, list(tokens), TREE_K, 0, tree=True)])
    [drafted_tree] = drafted
    shape = drafted_tree.shape
    assert (out.spec_token_ids["r"], out.spec_tree_parents["r"]) == drafted_tree.drafts() and not out.draft_probs
    assert len(out.spec_token_ids["r"]) == (5 if dynamic else len(TOKEN_TREE))
    assert len(outputs) == 1 + len(drafted_tree.passes) and shape.depth == TREE_K

    def dense(path: tuple[int, ...]) -> torch.Tensor:
        """The head's output at the path's last token, the head run densely over the context and the path, each
        step's feature its own output at the step before."""
        feats = [features] + [dense(path[:i])[None] for i in range(len(path))]
        with torch.no_grad():
            embeds = target.embed_tokens(torch.tensor(tokens[1:] + list(path)))
            return tree_head.forward_dense(embeds[None], torch.cat(feats)[None])[0, -1]

    for node, output in zip([0] + drafted_tree.passes, outputs):
        path = tuple(drafted_tree.token_ids[a] for a in shape.ancestors(node)[1:])
        expected = dense(path)
        torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-4)
        children = shape.children()[node]
        ranks = [drafted_tree.ranks[c] for c in children] if not dynamic else range(len(children))
        top = tree_head.logits(expected, target.lm_head).topk(drafted_tree.width).indices.tolist()
        assert [drafted_tree.token_ids[c] for c in children] == [top[r] for r in ranks]


# speculation with a tree on the default model (a random head: its drafts are seldom accepted; a trained one's are
# in test_eagle.py)

TREES = {"static": {"speculative_token_tree": TOKEN_TREE}, "dynamic": DYNAMIC}


@pytest.fixture(scope="module")
def eagle_tree_llm(model_path, smol_head) -> LLM:
    return LLM(model_path, kv_cache_memory=64 << 20, **FLOAT32, speculative_config=eagle(smol_head, **TREES["static"]))


def test_greedy_with_an_eagle_tree_matches_plain_decoding_alone_and_in_batch(eagle_tree_llm, prompts, reference):
    """Alone and two at a time every request verifies trees; three at a time, chains until one finishes."""
    trees = record_trees(eagle_tree_llm)
    assert token_ids(eagle_tree_llm, prompts[:1], greedy()) == reference[:1]
    assert token_ids(eagle_tree_llm, prompts[:2], greedy()) == reference[:2]
    assert 2 in trees
    trees.clear()
    assert token_ids(eagle_tree_llm, prompts, greedy()) == reference
    assert trees[0] == 0  # a busy batch verifies chains
    assert_all_blocks_free(eagle_tree_llm.llm_engine)


# per head kind: its heads' fixture; the KV cache's bytes, in target blocks, for 10 blocks (an EAGLE head's cache
# takes a share of 11); its speculative_config: Medusa's static tree, or EAGLE's dynamic one, which reserves the most
# lookahead slots (eagle_topk per depth: 4 here, to a static tree's 3)
CRAMPED_TREES = {"medusa": ("smol_heads", 10, lambda heads: medusa(heads, speculative_token_tree=TOKEN_TREE)),
                 "eagle": ("smol_head_whole", 11, lambda head: eagle(head, **DYNAMIC)),
                 "eagle, draft vocabulary": ("smol_head_draft", 11, lambda head: eagle(head, **DYNAMIC))}


@pytest.mark.parametrize("kind", CRAMPED_TREES)
def test_a_tree_with_chunked_prefill_and_preemption_matches_plain_decoding(request, kind, llm, model_path, prompts,
                                                                           reference):
    """Prompts cut into chunks of 32 tokens, and 10 KV blocks: the prompts fit, their outputs do not."""
    fixture, num_blocks, speculative_config = CRAMPED_TREES[kind]
    block_bytes = kv_bytes_per_block(llm.llm_engine.model_config, 16, llm.llm_engine.config.kv_cache_dtype)
    cramped = LLM(model_path, kv_cache_memory=num_blocks * block_bytes, max_num_batched_tokens=32, **FLOAT32,
                  speculative_config=speculative_config(request.getfixturevalue(fixture)))
    trees = record_trees(cramped)
    assert token_ids(cramped, prompts, greedy()) == reference
    assert cramped.llm_engine.scheduler.num_preemptions > 0 and max(trees) > 0
    assert_all_blocks_free(cramped.llm_engine)


def test_seeded_sampling_with_an_eagle_tree_is_reproducible(eagle_tree_llm, prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = token_ids(eagle_tree_llm, prompts[:1], seeded)
    assert token_ids(eagle_tree_llm, prompts[:1], seeded) == first


def test_a_tree_reading_more_tokens_than_the_vocabulary_is_refused(model_path, smol_head):
    with pytest.raises(ValueError, match="top 100001 tokens"):
        LLM(model_path, kv_cache_memory=16 << 20, **FLOAT32,
            speculative_config=eagle(smol_head, speculative_token_tree=[(0,), (100000,)]))
