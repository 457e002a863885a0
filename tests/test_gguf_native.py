"""GGUF files run as stored (quantization="auto", the default): every block type loads through its native form
(Q4_K and Q6_K as their super-blocks), which holds the file's weights bit-exactly (against
`gguf.quants.dequantize`), and the model computes what the dequantized float model (quantization=None) computes."""
import gguf
import numpy as np
import pytest
import torch

from conftest import num_clear_positions, prefill_logits, top2_gap
from inferno import LLM, SamplingParams
from inferno.config import EngineConfig
from inferno.cpu_features import has_native_bfloat16
from inferno.distributed.parallel_state import ParallelRank
from inferno.kernels.library import kernels_disabled
from inferno.layers.parallel_linear import GatheredRowParallel, RowParallelLinear
from inferno.layers.quantization.native import GGUFRowsEmbedding, QuantizedEmbedding
from inferno.layers.quantization.q4_k import Q4KBlocks, Q4KLinear
from inferno.layers.quantization.q6_k import Q6KBlocks, Q6KEmbedding, Q6KLinear
from inferno.layers.quantization.int4 import Int4Linear
from inferno.layers.quantization.q8 import Q8Linear
from inferno.layers.quantization.super_blocks import ShardedLinear
from inferno.loader.block_shards import rank_blocks
from inferno.loader.gguf_blocks import INT4_TYPES, Q8_TYPES, Int4Blocks, as_q8_groups, int4_groups, q8_groups
from inferno.loader.model_loader import load_model
from tiny_gguf import HEADS, HIDDEN, KV_HEADS, T, random_blocks, write_tiny_gguf
from tiny_models import write_gguf, write_hf_model

PROMPT = list(range(40, 60))  # 20 byte tokens: decode-sized row counts run the native kernels
# The native kernels quantize activations to int8 per block of 32 (as llama.cpp does): about 0.5% relative error per
# matmul for symmetric blocks, 1-1.5% for blocks with a min (Q4_1, Q5_1). Measured on these tiny models: the norm of
# the logits' difference over the norm of the float logits 0.028-0.032 (Q4_0, Q4_1, Q5_0, Q6_K, Q8_0), 0.064
# (Q5_1), 0.0003 (Q4_K, Q5_K: larger logits), 0.056 (Q4_K_M-like); the default model 0.038.
LOGIT_RELATIVE_TOLERANCE = 0.1
MIN_MARGIN = 0.3  # the float model's top-2 logit gap from which the native model must pick the same token
NATIVE_LAYERS = (Int4Linear, Q4KLinear, Q6KLinear, Q8Linear, ShardedLinear, QuantizedEmbedding, Q6KEmbedding,
                 GGUFRowsEmbedding)


def native_kinds(qtype: T) -> tuple[type, type, type]:
    """The projection, token embedding and LM head layers a file of `qtype` loads into."""
    if qtype == T.Q6_K:
        return Q6KLinear, Q6KEmbedding, Q6KLinear
    if qtype == T.Q4_K:
        return Q4KLinear, QuantizedEmbedding, Q8Linear
    return Int4Linear if qtype in INT4_TYPES else Q8Linear, QuantizedEmbedding, Q8Linear


@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda t: t.name)
def test_q8_groups_hold_the_blocks_bit_exactly(qtype):
    raw = random_blocks(qtype, 8, 512, np.random.default_rng(int(qtype)))
    expected = gguf.quants.dequantize(raw, qtype)
    weight = q8_groups(raw, qtype)
    assert weight.codes.dtype == torch.int8 and weight.group_size == (16 if qtype == T.Q6_K else 32)
    assert np.array_equal(weight.dequantize().numpy(), expected)


@pytest.mark.parametrize("qtype", INT4_TYPES, ids=lambda t: t.name)
def test_int4_groups_hold_the_blocks_bit_exactly(qtype):
    raw = random_blocks(qtype, 8, 512, np.random.default_rng(int(qtype)))
    weight = int4_groups(raw, qtype)
    assert weight.codes.max() <= 15 and weight.group_size == 32
    assert np.array_equal(weight.dequantize().numpy(), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", INT4_TYPES, ids=lambda t: t.name)
def test_int4_layout_holds_q4_0_and_q4_1_exactly(qtype):
    """Int4Linear stores a scale and a min per group as float16: the files' own d and m (Q4_0's min -8 d too)."""
    raw = random_blocks(qtype, 64, 512, np.random.default_rng(1))
    packed = Int4Linear(int4_groups(raw, qtype), None).dequantize()
    assert torch.equal(packed, torch.from_numpy(gguf.quants.dequantize(raw, qtype)))


def native_and_float(path) -> tuple[LLM, LLM]:
    native = LLM(model=str(path), kv_cache_memory=8 << 20, dtype="float32")
    assert native.llm_engine.config.quantization == "auto"
    return native, LLM(model=str(path), kv_cache_memory=8 << 20, quantization=None, dtype="float32")


def models(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.model_runner.model


def weight_of(layer: torch.nn.Module) -> torch.Tensor:
    """The float32 [N, K] weight a layer computes with."""
    if isinstance(layer, (Int4Linear, Q4KLinear, Q6KLinear, Q8Linear, ShardedLinear)):
        return layer.dequantize()[:, :layer.in_features]
    if isinstance(layer, QuantizedEmbedding):
        return layer.q8_groups.dequantize()
    if isinstance(layer, (Q6KEmbedding, GGUFRowsEmbedding)):
        return layer(torch.arange(layer.num_embeddings)).float()
    return layer.weight.float()


def assert_same_model(native: LLM, reference: LLM, prompt: list[int] = PROMPT) -> None:
    """The native layers hold the float model's weights exactly, the logits agree within LOGIT_RELATIVE_TOLERANCE,
    and so do the most likely tokens wherever the float model's top-2 margin exceeds MIN_MARGIN (prefill positions,
    then greedy decoding up to the first near-tie)."""
    ours, theirs = models(native), models(reference)
    for name, layer in ours.named_modules():
        if isinstance(layer, NATIVE_LAYERS) and ".parts." not in name:  # a ShardedLinear compares whole
            assert torch.equal(weight_of(layer), weight_of(theirs.get_submodule(name))), name
    native_logits = prefill_logits(native.llm_engine, prompt)
    float_logits = prefill_logits(reference.llm_engine, prompt)
    error = ((native_logits - float_logits).norm() / float_logits.norm()).item()
    assert error < LOGIT_RELATIVE_TOLERANCE
    margins = float_logits.topk(2).values.diff(dim=-1).neg().squeeze(-1)
    clear = margins > MIN_MARGIN
    assert clear.any(), "no prefill position with a clear margin: the comparison would compare nothing"
    assert torch.equal(native_logits.argmax(-1)[clear], float_logits.argmax(-1)[clear])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = reference.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    out = native.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    compared = 0
    for i, (token, logprobs) in enumerate(zip(ref.token_ids, ref.logprobs)):
        top2 = sorted((lp.logprob for lp in logprobs.values()), reverse=True)[:2]
        if top2[0] - top2[1] < MIN_MARGIN:
            break
        assert out.token_ids[i] == token, (i, out.token_ids, ref.token_ids)
        compared += 1
    print(f"logits relative error {error:.4f}, max {(native_logits - float_logits).abs().max():.3f}, "
          f"{int(clear.sum())}/{len(clear)} prefill positions and {compared} greedy tokens with a clear margin")


@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda t: t.name)
def test_every_type_runs_natively_and_matches_the_float_model(tmp_path, qtype):
    native, reference = native_and_float(write_tiny_gguf(tmp_path / "tiny.gguf", qtype))
    model = models(native)
    layer_kind, embedding_kind, head_kind = native_kinds(qtype)
    for layer in (model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.gate_up_proj, model.layers[1].mlp.down_proj):
        assert isinstance(layer, layer_kind)
    assert isinstance(model.embed_tokens, embedding_kind) and isinstance(model.lm_head, head_kind)
    codes = model.embed_tokens.blocks if qtype == T.Q6_K else model.embed_tokens.codes
    assert model.lm_head.weight.data_ptr() == codes.data_ptr()  # the tied head shares codes
    if qtype in (T.Q5_0, T.Q8_0) and not kernels_disabled():  # symmetric groups of 32: tiles, Q5_0's of 5-bit codes
        tiled = [m for m in model.modules() if isinstance(m, Q8Linear) and m.can_tile]
        assert tiled and all(m.tiles is not None and m.five_bit_tiles == (qtype == T.Q5_0) for m in tiled)
    assert_same_model(native, reference)


def test_q4_k_m_like_file_fuses_mixed_shards_in_one_exact_form(tmp_path):
    """Q/K as Q4_K and V as Q6_K: the fused qkv_proj keeps both types as stored (one kernel for Q/K stacked, one for
    V); the Q4_K gate/up, the Q6_K down_proj and LM head run as stored; the untied Q4_K embedding stays the file's blocks (rows converted on use)."""
    types = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K, "ffn_gate": T.Q4_K,
             "ffn_up": T.Q4_K, "ffn_down": T.Q6_K, "token_embd": T.Q4_K, "output": T.Q6_K}
    native, reference = native_and_float(write_tiny_gguf(tmp_path / "mixed.gguf", types, tied=False))
    model = models(native)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ShardedLinear) and [type(p) for p in qkv.parts] == [Q4KLinear, Q6KLinear]
    kv_rows = KV_HEADS * HIDDEN // HEADS
    assert (qkv.parts[0].out_features, qkv.parts[1].out_features) == (HIDDEN + kv_rows, kv_rows)  # q and k, v
    assert torch.equal(weight_of(qkv), weight_of(models(reference).layers[0].self_attn.qkv_proj))
    assert isinstance(model.layers[0].mlp.gate_up_proj, Q4KLinear)
    assert isinstance(model.layers[0].mlp.down_proj, Q6KLinear)
    assert isinstance(model.lm_head, Q6KLinear)
    assert isinstance(model.embed_tokens, GGUFRowsEmbedding) and model.embed_tokens.qtype == T.Q4_K
    assert_same_model(native, reference)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_llama_rotary_row_order_applies_to_native_blocks(tmp_path, qtype):
    native, reference = native_and_float(write_tiny_gguf(tmp_path / "llama.gguf", qtype, arch="llama"))
    assert_same_model(native, reference)


# the tiny MoE's experts: hidden 64, inner 32 (one block of 32 per row of down_proj)
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0], ids=lambda t: t.name)
def test_stacked_experts_run_as_stored(tmp_path, qtype):
    """llama.cpp's `ffn_*_exps` tensors ([experts, rows, columns] of blocks) are split per expert without
    dequantizing: every expert's projections run natively, hold the file's weights exactly, and the model computes
    what the dequantized float model computes."""
    hf_model = write_hf_model(tmp_path, "qwen2_moe")
    native, reference = native_and_float(write_gguf(tmp_path / "moe.gguf", hf_model, "qwen2moe", expert_type=qtype))
    layer_kind = Int4Linear if qtype in INT4_TYPES else Q8Linear
    experts = [e for layer in models(native).layers for e in layer.mlp.experts]
    assert len(experts) == 16
    for expert in experts:
        assert isinstance(expert.gate_up_proj, layer_kind) and isinstance(expert.down_proj, layer_kind)
    assert_same_model(native, reference)


def test_float_files_stay_float(tmp_path):
    llm = LLM(model=str(write_tiny_gguf(tmp_path / "f16.gguf", T.F16)), kv_cache_memory=8 << 20)
    model = models(llm)
    assert type(model.layers[0].self_attn.qkv_proj).__name__ == "QKVParallelLinear"
    assert not isinstance(model.embed_tokens, QuantizedEmbedding)


def test_default_model_runs_as_stored_and_matches_its_float_model():
    native = LLM(kv_cache_memory=64 << 20, dtype="float32")
    reference = LLM(kv_cache_memory=64 << 20, quantization=None, dtype="float32")
    model = models(native)
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int4Linear)  # Q4_1
    assert isinstance(model.embed_tokens, QuantizedEmbedding)  # Q8_0, and the tied LM head reads it
    assert isinstance(model.lm_head, Q8Linear) and model.lm_head.weight.data_ptr() == model.embed_tokens.codes.data_ptr()
    assert_same_model(native, reference, native.get_tokenizer().encode(
        "The capital of France is Paris. The capital of Germany is"))


def test_engine_defaults():
    config = EngineConfig()
    assert config.quantization == "auto"
    assert config.dtype == "float32"  # the default model's blocks run in the integer kernels, on every CPU
    assert config.kv_cache_dtype == "float16"
    assert EngineConfig(quantization=None).dtype == ("bfloat16" if has_native_bfloat16() else "float32")
    assert EngineConfig(tensor_parallel_size=2).quantization == "auto"  # each rank runs its part of the blocks
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(quantization="int4", tensor_parallel_size=2)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_tensor_parallel_ranks_compute_one_process_outputs(tmp_path, qtype):
    """With tensor_parallel_size=2 each rank holds its output rows of every layer's blocks (of the vocabulary, the
    column-parallel layers, and the row-parallel ones, which run on the gathered input) in the layer one process
    has: every output it computes is one process's, bit for bit (the next layer's int8 activations would turn a
    last-bit difference into a different rounding)."""
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", qtype))
    single = load_model(path, torch.float32, quantization="auto").model
    ranks = [load_model(path, torch.float32, ParallelRank(r, tp_size=2), quantization="auto").model for r in range(2)]
    torch.manual_seed(0)
    for name in ("layers.0.self_attn.o_proj", "layers.1.mlp.down_proj"):
        whole, parts = single.get_submodule(name), [rank.get_submodule(name) for rank in ranks]
        assert all(isinstance(p, GatheredRowParallel) and type(p.layer) is type(whole) for p in parts)
        x = torch.randn(3, whole.in_features)
        assert torch.equal(torch.cat([p.layer(x) for p in parts], dim=1), whole(x)), name
    x = torch.randn(3, HIDDEN)
    gate_up = single.layers[0].mlp.gate_up_proj(x).view(3, 2, 2, -1)  # (gate, up) x (rank 0's rows, rank 1's)
    for r, rank in enumerate(ranks):
        assert type(rank.layers[0].mlp.gate_up_proj) is type(single.layers[0].mlp.gate_up_proj)
        assert torch.equal(rank.layers[0].mlp.gate_up_proj(x), gate_up[:, :, r].reshape(3, -1))
        assert type(rank.embed_tokens.quantized) is type(single.embed_tokens)
        rows = rank.embed_tokens.vocab_rows
        ids = torch.tensor([rows.start, rows.stop - 1])
        assert torch.equal(rank.embed_tokens.embed(ids - rows.start), single.embed_tokens(ids))
        assert torch.equal(rank.lm_head.quantized(x), single.lm_head(x)[:, rows.start:rows.stop])


@pytest.mark.parametrize("split", [128, 256])  # inside a K-quant super-block, at its end
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_expert_down_proj_ranks_keep_whole_activation_blocks(qtype, split):
    """A MoE expert's down_proj (its block sums the experts before one all-reduce) keeps its input columns, cut at
    whole blocks of 32: each rank's int8 activation blocks are one process's, so the ranks' partial outputs add up
    to one process's up to float rounding (a scale per rank's half of a row would be off by the activations'
    quantization error, about 0.5%)."""
    raw = torch.from_numpy(random_blocks(qtype, 32, 512, np.random.default_rng(0)))
    blocks = {T.Q4_1: Int4Blocks(raw, T.Q4_1), T.Q4_K: Q4KBlocks(raw), T.Q6_K: Q6KBlocks(raw)}.get(qtype) \
        or q8_groups(raw, qtype)
    layer = lambda b: Q8Linear(as_q8_groups(b, 16 if qtype == T.Q6_K else 32), b.shape[1])  # noqa: E731
    parts = [rank_blocks(blocks, RowParallelLinear(512, columns, 32, ParallelRank(r, tp_size=2), reduce=False), 0)
             for r, columns in enumerate([range(0, split), range(split, 512)])]
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    expected = layer(blocks)(x)
    y = layer(parts[0])(x[:, :split]) + layer(parts[1])(x[:, split:])
    assert (y - expected).abs().max() < 1e-5 * expected.abs().max()


def test_each_pipeline_stage_keeps_its_own_layers_quantized(tmp_path):
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", T.Q6_K))
    first = load_model(path, torch.float32, ParallelRank(0, pp_size=2), quantization="auto").model
    last = load_model(path, torch.float32, ParallelRank(1, pp_size=2), quantization="auto").model
    assert list(first.stage_layers) == [0] and list(last.stage_layers) == [1]
    assert isinstance(first.layers[0].mlp.down_proj, Q6KLinear) and isinstance(first.embed_tokens, Q6KEmbedding)
    assert isinstance(last.layers[1].mlp.down_proj, Q6KLinear) and last.embed_tokens is None


def test_draft_model_speculation_runs_as_stored_and_accepts_itself(tmp_path):
    """The draft loads with the target's options: the default model as its own draft (both native) gives plain
    greedy decoding's tokens up to the first near-tie of plain decoding, nearly every draft accepted (the 1-row draft
    steps run compiled, the 4-row verification eagerly: bfloat16 elementwise ops fused differently, so a near-tie may
    flip)."""
    plain = LLM(kv_cache_memory=32 << 20)
    path = plain.llm_engine.model_path
    spec = LLM(kv_cache_memory=32 << 20, speculative_config={"method": "draft_model", "model": path,
                                                             "num_speculative_tokens": 3})
    draft_runner = spec.llm_engine.executor.worker.proposer.runner
    assert isinstance(draft_runner.model.layers[0].mlp.down_proj, Int4Linear)
    for runner in (plain.llm_engine.model_runner, spec.llm_engine.model_runner, draft_runner):
        runner.wait_for_warm_up()  # every weight tiled: the steps differ only in how their elementwise ops fuse
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = "The capital of France is"
    with_logprobs = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)  # (not speculated)
    expected = plain.generate(prompt, with_logprobs)[0].outputs[0]
    # bfloat16 activations: the two orders of the sums move log-probabilities by up to about 0.1 here
    clear = num_clear_positions([top2_gap(p) for p in expected.logprobs], logit_tolerance=0.1, min_compared=4)
    assert spec.generate(prompt, params)[0].outputs[0].token_ids[:clear] == expected.token_ids[:clear]
    assert spec.llm_engine.spec_decoding_stats.acceptance_rate >= 0.8
