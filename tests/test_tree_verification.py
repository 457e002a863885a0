"""Draft trees verified by the target: each node's logits equal a separate forward of its path (the dense
reference) on each CPU attention backend, and a verified tree leaves exactly its accepted path's K/V in place."""
import pytest
import torch

from conftest import FLOAT32, prefill_logits
from native_kernels import kernels_disabled
from inferno import LLM
from inferno.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from inferno.core.spec_tree import SpecTree
from inferno.layers.attention import Attention
from inferno.layers.attention.triton_backend import TritonAttentionBackend
from inferno.request import Request
from inferno.sampling_params import SamplingParams
from inferno.worker.input_batch import StepInput, TokenChunk, lay_out_chunks

# the root has three children (1, 2, 3); node 1 has two (4, 5), node 2 one (6), node 4 two (7, 8): depth up to 3
TREE = SpecTree((0, 0, 0, 1, 1, 2, 4, 4))
LOGIT_TOLERANCE = 2e-3  # float32: a decode row against a prefill over the same tokens
BACKENDS = ["torch", pytest.param("cpu_kernel", marks=pytest.mark.skipif(kernels_disabled(), reason="no kernels"))]


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request):
    return LLM(kv_cache_memory=64 << 20, attention_backend=request.param, **FLOAT32).llm_engine


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome. The capital of")


def test_tree_layout_positions_slots_and_hidden_branches():
    mb = lay_out_chunks([TokenChunk([9] * 9, 20, list(range(4)), tree=TREE)], 16)
    assert mb.positions == [20 + depth for depth in (0, 1, 1, 1, 2, 2, 2, 3, 3)]
    assert mb.slot_mapping == list(range(20, 29))  # nodes fill consecutive slots in layout order
    assert [seq_len for seq_len, _ in mb.decodes] == list(range(21, 30))
    assert mb.tree_hidden_keys[8] == [22, 23, 25, 26, 27]  # node 8 (path 0-1-4-8) sees slots 20, 21, 24, 28
    assert 1 not in mb.tree_hidden_keys and mb.tree_hidden_keys[2] == [21]  # node 2 hides its sibling 1
    with pytest.raises(ValueError, match="parent"):
        SpecTree((0, 2))


def tree_logits(engine, prompt: list[int], drafts: list[int], tree: SpecTree | None) -> torch.Tensor:
    """Logits of every node of a tree under `prompt`'s last token (tree None: the same tokens as a chain)."""
    req = Request("tree", prompt, SamplingParams(), set(), engine.max_model_len)
    assert engine.kv_cache_manager.allocate_slots(req, len(prompt) + len(drafts))
    try:
        block_size = engine.config.block_size
        context = lay_out_chunks([TokenChunk(prompt[:-1], 0, req.block_ids)], block_size)
        engine.executor.run_step(StepInput([context], []))
        mb = lay_out_chunks([TokenChunk(prompt[-1:] + drafts, len(prompt) - 1, req.block_ids, tree=tree)], block_size)
        mb.logit_rows = list(range(len(drafts) + 1))
        return engine.executor.run_step(StepInput([mb], []))
    finally:
        engine.kv_cache_manager.free(req)


def path_logits(engine, prompt: list[int], drafts: list[int], node: int) -> torch.Tensor:
    """The dense reference: the prompt and the drafts on the path to `node` as one prompt, its last logits."""
    return prefill_logits(engine, prompt + [drafts[n - 1] for n in TREE.ancestors(node)[1:]])[-1]


def test_each_node_of_a_tree_scores_like_a_separate_forward_of_its_path(engine, prompt):
    drafts = torch.randint(0, 1000, (TREE.num_nodes - 1,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = tree_logits(engine, prompt, drafts, TREE)
    reference = torch.stack([path_logits(engine, prompt, drafts, node) for node in range(TREE.num_nodes)])
    assert (logits - reference).abs().max().item() < LOGIT_TOLERANCE
    # the check has power: the same tokens verified as a chain (every node seeing all before it) do not match
    as_chain = tree_logits(engine, prompt, drafts, None)
    assert (as_chain - reference).abs().amax(dim=-1).max().item() > 100 * LOGIT_TOLERANCE


def greedy_continuation(engine, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens by recomputing the whole sequence each time, each a clear choice."""
    tokens = list(prompt)
    for _ in range(n):
        (best, second), (token, _) = (x.tolist() for x in prefill_logits(engine, tokens)[-1].topk(2))
        assert best - second > 2 * LOGIT_TOLERANCE, "a near-tie: pick another prompt"
        tokens.append(token)
    return tokens[len(prompt):]


def test_greedy_tree_keeps_the_matching_branch_and_its_kv(engine, prompt):
    """A tree whose branch 0-1-4-8 holds the greedy continuation (decoys elsewhere, node 7 a decoy sibling laid
    out before node 8): the step emits that branch and the bonus token, and the next decode, which reads the
    moved K/V of nodes 4 and 8 at positions root + 2 and root + 3, scores like a separate forward."""
    g = greedy_continuation(engine, prompt, 6)
    d = [(token + 1) % 1000 for token in g]  # decoys: never the greedy token where they stand
    drafts = [g[1], d[1], d[1], g[2], d[2], g[2], d[3], g[3]]
    runner, rid = engine.executor.model_runner, "greedy-tree"
    req = Request(rid, prompt, SamplingParams(temperature=0.0), set(), engine.max_model_len)
    assert engine.kv_cache_manager.allocate_slots(req, len(prompt) + 1 + len(drafts))
    try:
        new = NewRequestData(rid, prompt, [], req.sampling_params, set(), req.block_ids, 0)
        out = engine.executor.execute_model(SchedulerOutput([new], CachedRequestData(), {rid: len(prompt)}))
        assert out.sampled_token_ids[rid] == g[:1]
        cached = CachedRequestData([rid], [g[:1]], [[]], [False], [len(prompt)])
        out = engine.executor.execute_model(SchedulerOutput(
            [], cached, {rid: 1 + len(drafts)}, spec_token_ids={rid: drafts},
            spec_tree_parents={rid: list(TREE.parents)}))
        assert out.sampled_token_ids[rid] == g[1:5]
        sequence = prompt + g[:5]
        decode = lay_out_chunks([TokenChunk(g[4:5], len(sequence) - 1, req.block_ids)], engine.config.block_size)
        logits = engine.executor.run_step(StepInput([decode], []))[0]
        assert (logits - prefill_logits(engine, sequence)[-1]).abs().max().item() < LOGIT_TOLERANCE
    finally:
        runner.requests.pop(rid, None)
        engine.kv_cache_manager.free(req)
    assert engine.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("quantized", [False, True])
def test_moving_slots_moves_keys_values_and_scales_of_those_slots_only(quantized):
    attn = Attention(4, 2, 16)
    caches = [torch.randn(2, 3, 4, 16) for _ in range(2)]  # [kv_heads, blocks, block_size, head_dim]
    if quantized:
        caches = [c.mul(20).to(torch.int8) for c in caches]
        attn.k_scale, attn.v_scale = torch.rand(2, 3, 4), torch.rand(2, 3, 4)
    attn.k_cache, attn.v_cache = caches
    tensors = [t for t in (attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale) if t is not None]
    before = [t.clone().view(2, 12, -1) for t in tensors]
    attn.move_slots(torch.tensor([5, 9]), torch.tensor([1, 2]))
    for tensor, old in zip(tensors, before):
        new = tensor.view(2, 12, -1)
        assert torch.equal(new[:, [1, 2]], old[:, [5, 9]])
        kept = [s for s in range(12) if s not in (1, 2)]
        assert torch.equal(new[:, kept], old[:, kept])


def test_triton_refuses_trees_clearly():
    backend = TritonAttentionBackend(16, torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="tree"):
        backend.build_metadata([0, 1], [(1, [0]), (2, [0])], [], {1: [0]})
