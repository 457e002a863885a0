"""Medusa heads: their folder formats, speculation with them (the output is the target's), and heads trained here
(`inferno train-draft-heads`) that a tiny model's drafts get accepted from."""
import contextlib
import io
import json

import pytest
import torch

from conftest import FLOAT32, assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.entrypoints.cli import main
from inferno.loader.medusa_folder import MedusaFolder, read_medusa_folder, write_medusa_folder
from inferno.worker.model_runner import kv_bytes_per_block
from inferno.worker.spec_decode.medusa import build_medusa_heads
from test_spec_decode import MAX_TOKENS, greedy, prompts, reference, token_ids  # noqa: F401 (fixtures)

NUM_HEADS = 3
CYCLE = 12  # the cycle model's tokens, each followed by the next


def medusa(folder, **options) -> dict:
    return {"method": "medusa", "model": str(folder), "num_speculative_tokens": NUM_HEADS,
            "disable_by_batch_size": None, "draft_acceptance_threshold": 0, **options}


def random_heads(hidden: int, vocab: int, own_lm_heads: bool, scale: float = 0.02) -> MedusaFolder:
    blocks = [[(torch.randn(hidden, hidden) * scale, torch.randn(hidden) * scale)] for _ in range(NUM_HEADS)]
    lm_heads = [torch.randn(vocab, hidden) for _ in range(NUM_HEADS)] if own_lm_heads else None
    return MedusaFolder(NUM_HEADS, 1, blocks, lm_heads, "test")


# formats

def write_vllm_layout(folder, heads: MedusaFolder) -> None:
    from safetensors.torch import save_file
    folder.mkdir()
    tensors = {}
    for h, blocks in enumerate(heads.blocks):
        weight, bias = blocks[0]
        tensors |= {f"blocks.{h}.layers.0.weight": weight, f"blocks.{h}.layers.0.bias": bias,
                    f"lm_heads.{h}.weight": heads.lm_heads[h]}
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": NUM_HEADS,
                                                    "num_hidden_layers": 1, "medusa_fc_bias": True}))


def test_reference_and_vllm_layouts_load_the_same_heads(tmp_path):
    torch.manual_seed(0)
    heads = random_heads(16, 50, own_lm_heads=True, scale=0.5)
    write_medusa_folder(tmp_path / "reference", heads)
    write_vllm_layout(tmp_path / "vllm", heads)
    torch.save({f"{h}.0.linear.weight": w for h, ((w, _),) in enumerate(heads.blocks)}
               | {f"{h}.0.linear.bias": b for h, ((_, b),) in enumerate(heads.blocks)}
               | {f"{h}.1.weight": lm for h, lm in enumerate(heads.lm_heads)}, tmp_path / "medusa_lm_head.pt")
    (tmp_path / "pt").mkdir()
    (tmp_path / "medusa_lm_head.pt").rename(tmp_path / "pt" / "medusa_lm_head.pt")
    (tmp_path / "pt" / "config.json").write_text(json.dumps({"medusa_num_heads": NUM_HEADS, "medusa_num_layers": 1}))
    hidden = torch.randn(5, 16)
    # the reference's formula: head j = LM head j (x + SiLU(W_j x + b_j))
    expected = torch.stack([(hidden + torch.nn.functional.silu(hidden @ w.t() + b)) @ lm.t()
                            for ((w, b),), lm in zip(heads.blocks, heads.lm_heads)])
    for layout in ("reference", "vllm", "pt"):
        loaded = build_medusa_heads(read_medusa_folder(tmp_path / layout), 16, 50)
        torch.testing.assert_close(loaded.logits(hidden), expected, msg=layout)


def test_bad_folders_are_refused_with_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        read_medusa_folder(tmp_path)
    write_medusa_folder(tmp_path / "base", random_heads(16, 50, own_lm_heads=False))
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    assert config["base_lm_head"] is True and config["medusa_num_heads"] == NUM_HEADS
    (tmp_path / "base" / "config.json").write_text(json.dumps(config | {"base_lm_head": False}))
    with pytest.raises(ValueError, match="base_lm_head"):
        read_medusa_folder(tmp_path / "base")
    write_medusa_folder(tmp_path / "wide", random_heads(24, 50, own_lm_heads=False))
    with pytest.raises(ValueError, match="hidden size 16"):
        build_medusa_heads(read_medusa_folder(tmp_path / "wide"), 16, 50)
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(speculative_config={"method": "medusa", "num_speculative_tokens": 2})


# speculation on the default model: heads over its own LM head (their drafts are accepted only now and then)

@pytest.fixture(scope="module")
def smol_heads(llm, tmp_path_factory) -> str:
    config = llm.llm_engine.model_config
    torch.manual_seed(0)
    return str(write_medusa_folder(tmp_path_factory.mktemp("smol_heads"),
                                   random_heads(config.hidden_size, config.vocab_size, own_lm_heads=False)))


@pytest.fixture(scope="module")
def medusa_llm(model_path, smol_heads) -> LLM:
    return LLM(model_path, kv_cache_memory=64 << 20, speculative_config=medusa(smol_heads), **FLOAT32)


def test_greedy_with_medusa_heads_matches_plain_decoding_alone_and_in_batch(medusa_llm, prompts, reference):
    stats = medusa_llm.llm_engine.spec_decoding_stats
    assert token_ids(medusa_llm, prompts[:1], greedy()) == reference[:1]
    assert token_ids(medusa_llm, prompts, greedy()) == reference
    assert stats.num_draft_tokens_per_pos[NUM_HEADS - 1] > 0  # every head proposed


def test_medusa_with_chunked_prefill_and_preemption_matches_plain_decoding(llm, model_path, smol_heads, prompts,
                                                                           reference):
    """Prompts cut into chunks of 32 tokens, and 10 KV blocks: the prompts fit, their outputs do not."""
    block_bytes = kv_bytes_per_block(llm.llm_engine.model_config, 16, llm.llm_engine.config.kv_cache_dtype)
    cramped = LLM(model_path, kv_cache_memory=10 * block_bytes, max_num_batched_tokens=32,
                  speculative_config=medusa(smol_heads), **FLOAT32)
    assert token_ids(cramped, prompts, greedy()) == reference
    assert cramped.llm_engine.scheduler.num_preemptions > 0


def test_seeded_sampling_with_medusa_is_reproducible_in_any_batch(medusa_llm, prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = token_ids(medusa_llm, prompts[:1], seeded)[0]
    mixed = token_ids(medusa_llm, prompts, [seeded, SamplingParams(temperature=1.0, max_tokens=12), greedy()])[0]
    assert mixed == alone


# token trees: Medusa's top-k per head under a small static tree (7 nodes, 3 deep); under chunked prefill and
# preemption beside EAGLE's in test_eagle_tree.py
TOKEN_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def record_trees(llm: LLM) -> list[int]:
    """How many requests proposed a tree at each planning (a spy on the policy's choice)."""
    policy, counts = llm.llm_engine.scheduler.spec_policy, []
    choose = policy.tree_requests

    def recorded(planned, num_running: int) -> set[str]:
        chosen = choose(planned, num_running)
        counts.append(len(chosen))
        return chosen
    policy.tree_requests = recorded
    return counts


@pytest.fixture(scope="module")
def medusa_tree_llm(model_path, smol_heads) -> LLM:
    return LLM(model_path, kv_cache_memory=64 << 20, **FLOAT32,
               speculative_config=medusa(smol_heads, speculative_token_tree=TOKEN_TREE))


def test_greedy_with_a_medusa_tree_matches_plain_decoding_alone_and_in_batch(medusa_tree_llm, prompts, reference):
    """Alone and two at a time every request verifies trees; three at a time, chains until one finishes."""
    trees = record_trees(medusa_tree_llm)
    stats = medusa_tree_llm.llm_engine.spec_decoding_stats
    assert token_ids(medusa_tree_llm, prompts[:1], greedy()) == reference[:1]
    assert token_ids(medusa_tree_llm, prompts[:2], greedy()) == reference[:2]
    assert 2 in trees and stats.num_accepted_tokens > 0
    trees.clear()
    assert token_ids(medusa_tree_llm, prompts, greedy()) == reference
    assert trees[0] == 0  # a busy batch verifies chains
    assert_all_blocks_free(medusa_tree_llm.llm_engine)


def test_seeded_sampling_with_a_medusa_tree_is_reproducible(medusa_tree_llm, prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = token_ids(medusa_tree_llm, prompts[:1], seeded)
    assert token_ids(medusa_tree_llm, prompts[:1], seeded) == first


# heads trained here, on a model whose continuations they can learn

def write_cycle_model(folder, tokenizer, hidden_size: int = 64) -> list[int]:
    """A Llama whose layers add nothing (zero output projections) and whose LM head maps each of CYCLE tokens to
    the next one, round (any other token to one of them): its greedy continuations walk the cycle. Its heads must
    learn to skip ahead: head j, the token j + 2 after. Returns the cycle."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden_size,
                                         intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                                         tie_word_embeddings=False))
    cycle = torch.randperm(tokenizer.vocab_size - 1000)[:CYCLE] + 1000
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        model.lm_head.weight.zero_()
        for i, token in enumerate(cycle.tolist()):
            nxt = cycle[(i + 1) % CYCLE]
            model.lm_head.weight[nxt] = 4 * embed[token] / embed[token].norm()
    model.save_pretrained(folder)
    tokenizer._tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return cycle.tolist()


@pytest.fixture(scope="module")
def cycle_model(llm, tmp_path_factory) -> tuple[str, list[int]]:
    folder = tmp_path_factory.mktemp("cycle_model")
    return str(folder), write_cycle_model(folder, llm.get_tokenizer())


def write_training_prompts(folder) -> str:
    """Text and chat prompts for `inferno train-draft-heads` in `folder`; the file's path."""
    words = "the cat sat on a mat and ran to the red house by the river where fish swim all day".split()
    lines = [{"prompt": " ".join(words[i:] + words[:i])} for i in range(len(words))]
    lines += [{"messages": [{"role": "user", "content": w}]} for w in words[:4]]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(folder / "prompts.jsonl")


@pytest.fixture(scope="module")
def trained_heads(cycle_model, tmp_path_factory) -> tuple[str, list[float]]:
    """Heads trained with `inferno train-draft-heads` on text and chat prompts; their folder and the held-out
    top-1 accuracy per head it printed."""
    prompts = write_training_prompts(tmp_path_factory.mktemp("prompts"))
    output = tmp_path_factory.mktemp("trained") / "heads"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["train-draft-heads", cycle_model[0], "--prompts", str(prompts), "--output", str(output),
              "--num-heads", str(NUM_HEADS), "--max-tokens", "24", "--epochs", "8", "--learning-rate", "0.01",
              "--batch-size", "64", "--held-out-fraction", "0.2", "--kv-cache-memory", str(32 << 20)])
    accuracy = [float(a) for a in printed.getvalue().split("per head:")[1].split()]
    return str(output), accuracy


def test_trained_heads_learn_the_continuations(trained_heads):
    """Held out, each head's top-1 is the token it must predict at 90% of the positions or more (the LM head they
    start from predicts the next token, never the one after it on the cycle)."""
    folder, accuracy = trained_heads
    assert len(accuracy) == NUM_HEADS and min(accuracy) >= 0.9, accuracy
    assert read_medusa_folder(folder).lm_heads is None  # they end in the target's own LM head


def test_trained_heads_drafts_are_accepted_and_output_is_unchanged(cycle_model, trained_heads):
    folder, cycle = cycle_model
    plain = LLM(folder, kv_cache_memory=16 << 20, **FLOAT32)
    spec = LLM(folder, kv_cache_memory=16 << 20, speculative_config=medusa(trained_heads[0]), **FLOAT32)
    prompts = [[5, 6, 7, 8], [cycle[3]], [100, cycle[7], 200]]
    params = greedy(max_tokens=24)
    expected = token_ids(plain, prompts, params)
    assert all(t in cycle for out in expected for t in out)
    assert token_ids(spec, prompts, params) == expected
    stats = spec.llm_engine.spec_decoding_stats
    # every head's drafts are taken once on the cycle (the first step's, from a prompt token off it, need not be)
    assert min(stats.acceptance_rate_per_pos) >= 0.75, stats.acceptance_rate_per_pos
    assert stats.mean_acceptance_length > 3
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
