"""Multi-LoRA cost: a batch over several adapters against the same batch on the base model, and batch-1 decode with
an adapter against without.

Model: --model (default: Qwen2.5-Coder-0.5B-Instruct Q4_K_M at /work/models, else a random-weight model of its shapes
written once under --workdir). Adapters: --num-adapters random PEFT adapters of rank --rank over every projection
(q, k, v, o, gate, up, down; A ~ N(0, 1/in), B ~ N(0, 0.02²): B is not zero, so the product is real work), written
to --workdir.

Two engines on the same file with the same options, prefix caching off (repeats would hit it), warmed up (tiles
and the compiled decode step) before timing, measured in turns, medians of --repeats:
  base: enable_lora=False. lora: enable_lora=True, max_loras=--num-adapters, max_lora_rank=--rank.
Rows:
  batch: --batch requests of --prompt-len random token ids and --output-len new tokens (ignore_eos) in one
         `generate` call; output tok/s = output tokens / wall time. base engine, no adapter; lora engine, no
         adapter (what enabling LoRA costs the base model); lora engine, the requests spread round-robin over the
         adapters (goal: >= 0.8x the base engine).
  batch 1: one request, decode tok/s = (output - 1) / (finished - first token time); base engine vs lora engine
         with one adapter (goal: >= 0.85x).
Prints the table and replaces the `lora` section of --output.
"""
import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from inferno import LLM, LoRARequest, SamplingParams
from inferno.config import ModelConfig
from inferno.loader.gguf import open_gguf, read_config
from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)

DEFAULT_MODEL = Path("/work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
# Qwen2.5-Coder-0.5B's shapes, for the random-weight stand-in when the GGUF file is not there
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=True)
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(slots=True)
class Row:
    name: str
    engine: str
    adapters: str
    tok_s: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.tok_s)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"GGUF file or HF folder (default: {DEFAULT_MODEL} if present, "
                                                 "else a random-weight model of its shapes)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/inferno-lora-bench"),
                   help="where the adapters (and the stand-in model) are written")
    for name, default in [("num-adapters", 4), ("rank", 16), ("batch", 16), ("prompt-len", 64), ("output-len", 64),
                          ("single-output", 64), ("repeats", 3), ("seed", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto", help="'none': the weights dequantized to --dtype")
    p.add_argument("--num-threads", type=int, default=None, help="default: the engine's choice")
    p.add_argument("--warm-up-timeout", type=float, default=900.0, help="seconds to wait for the compiled step")
    p.add_argument("--output", default=str(Path(__file__).parent / "RESULTS.md"), help="'' = no RESULTS.md section")
    return p.parse_args()


# model and adapters
def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if DEFAULT_MODEL.exists():
        return str(DEFAULT_MODEL)
    folder = args.workdir / "qwen2.5-0.5b-shapes"
    if not (folder / "config.json").exists():
        write_random_model(folder)
    return str(folder)


def write_random_model(folder: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN_05B)).to(torch.bfloat16)
    model.save_pretrained(folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # a byte-level vocabulary: prompts are token ids anyway
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))


def base_config(path: str) -> ModelConfig:
    if path.endswith(".gguf"):
        return read_config(open_gguf(path))
    hf = json.loads((Path(path) / "config.json").read_text())
    heads = hf["num_attention_heads"]
    return ModelConfig("qwen2", hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"],
                       hf["num_hidden_layers"], heads, hf["num_key_value_heads"], hf["hidden_size"] // heads,
                       hf["rms_norm_eps"], hf["rope_theta"], hf["max_position_embeddings"], hf["tie_word_embeddings"])


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A PEFT adapter (adapter_config.json + adapter_model.safetensors) of random A and B on every projection."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (n_in, n_out) in projection_shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) / n_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(n_out, rank, generator=generator)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(PROJECTIONS),
        "bias": "none", "use_rslora": False, "modules_to_save": None}))


# measurements
def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def batch_tok_s(llm: LLM, prompts: list[list[int]], output_len: int, loras: list[LoRARequest | None]) -> float:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(output_len), use_tqdm=False,
                        lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def decode_tok_s(llm: LLM, prompt: list[int], output_len: int, lora: LoRARequest | None) -> float:
    m = llm.generate([{"prompt_token_ids": prompt}], greedy(output_len), use_tqdm=False, lora_request=lora)[0].metrics
    return (output_len - 1) / (m.finished_time - m.first_token_time)


def start_engine(path: str, args: argparse.Namespace, loras: list[LoRARequest]) -> LLM:
    options = dict(dtype=args.dtype, quantization=None if args.quantization == "none" else args.quantization,
                   enable_prefix_caching=False, max_model_len=max(512, args.prompt_len + args.output_len + 8))
    if args.num_threads:
        options["num_threads"] = args.num_threads
    if loras:
        options.update(enable_lora=True, max_loras=len(loras), max_lora_rank=args.rank)
    llm = LLM(path, **options)
    warm = [[1, 2, 3, 4]] * max(1, len(loras))
    llm.generate([{"prompt_token_ids": p} for p in warm], greedy(4), use_tqdm=False, lora_request=loras or None)
    compiled = llm.wait_for_warm_up(args.warm_up_timeout)
    llm.generate([{"prompt_token_ids": p} for p in warm], greedy(4), use_tqdm=False, lora_request=loras or None)
    print(f"engine {'lora' if loras else 'base'} ready ({'compiled' if compiled else 'eager'} decode)", flush=True)
    return llm


def report(rows: list[Row], args: argparse.Namespace, path: str, repeats_done: int) -> str:
    by_name = {row.name: row for row in rows}
    lines = ["| workload | engine | adapters | output tok/s | vs base | goal |", "|---|---|---|---:|---:|---:|"]
    goals = {"batch": 0.8, "batch 1": 0.85}
    for row in rows:
        workload = row.name.split(":")[0]
        ratio = row.median / by_name[f"{workload}:base"].median
        goal = f"≥ {goals[workload]}×" if row.name.endswith(":adapters") else ""
        lines.append(f"| {workload} | {row.engine} | {row.adapters} | {row.median:.1f} | {ratio:.2f}× | {goal} |")
    return "\n".join([
        "## Multi-LoRA (`benchmarks/lora.py`)",
        "",
        f"- Command: `{shlex.join(['python', sys.argv[0], *sys.argv[1:]])}`",
        f"- Model: {path}; {args.num_adapters} random adapters of rank {args.rank} on q, k, v, o, gate, up, down; "
        f"dtype {args.dtype}, quantization {args.quantization}, {torch.get_num_threads()} torch threads",
        f"- batch: {args.batch} requests of {args.prompt_len} prompt tokens and {args.output_len} new tokens in one "
        "`generate` call (adapters round-robin), output tokens / wall time; batch 1: decode tok/s of one request "
        f"({args.single_output} new tokens); medians of {repeats_done} repeats, engines in turns, prefix caching off",
        "",
        "\n".join(lines),
    ])


def main() -> None:
    args = parse_args()
    path = model_path(args)
    config = base_config(path)
    loras = []
    for i in range(args.num_adapters):
        folder = args.workdir / f"adapter-{config.hidden_size}-r{args.rank}-{i}"
        if not (folder / "adapter_config.json").exists():
            write_adapter(folder, config, args.rank, seed=i)
        loras.append(LoRARequest(f"adapter-{i}", i + 1, str(folder)))
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, min(config.vocab_size, 32000), args.prompt_len).tolist() for _ in range(args.batch)]
    spread = [loras[i % len(loras)] for i in range(args.batch)]
    base, lora = start_engine(path, args, []), start_engine(path, args, loras)
    rows = [Row("batch:base", "base", "–"), Row("batch:lora engine", "lora", "none"),
            Row("batch:adapters", "lora", f"{args.num_adapters}, round-robin"),
            Row("batch 1:base", "base", "–"), Row("batch 1:adapters", "lora", "1")]
    runs = {"batch:base": lambda: batch_tok_s(base, prompts, args.output_len, [None] * args.batch),
            "batch:lora engine": lambda: batch_tok_s(lora, prompts, args.output_len, [None] * args.batch),
            "batch:adapters": lambda: batch_tok_s(lora, prompts, args.output_len, spread),
            "batch 1:base": lambda: decode_tok_s(base, prompts[0], args.single_output, None),
            "batch 1:adapters": lambda: decode_tok_s(lora, prompts[0], args.single_output, loras[0])}
    for repeat in range(args.repeats):
        for row in rows:
            row.tok_s.append(runs[row.name]())
            print(f"repeat {repeat + 1}: {row.name}: {row.tok_s[-1]:.1f} tok/s", flush=True)
        if args.output:  # partial results survive a stop
            write_section(Path(args.output), "lora", report(rows, args, path, repeat + 1))
    print(report(rows, args, path, args.repeats))


if __name__ == "__main__":
    main()
