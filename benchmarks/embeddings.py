"""Embeddings throughput: inferno's `LLM.embed` against sentence-transformers' `encode()` on the same weights and
threads, for short and long texts.

The model is a sentence-transformers folder (last-token pooling, normalized: Qwen3-Embedding's recipe): `--model`
names one (any folder of an architecture inferno runs, e.g. Qwen/Qwen3-Embedding-0.6B), else the default model's
GGUF (SmolLM2-135M-Instruct Q4_1) is dequantized by transformers and saved as one, so that both engines hold the
same weights. What runs:

- sentence-transformers: `encode(texts, batch_size=--batch-size)` in float32 (its default on the CPU), with
  `torch.set_num_threads(--threads)`; it sorts the texts by length and pads each batch to its longest.
- inferno on the folder: `LLM(folder, runner="pooling", num_threads=--threads)` with its defaults (dtype "auto":
  float32 on CPUs without native bfloat16, bfloat16 on those with it), `--quantization` adding a row with quantized
  weights;
- inferno on the GGUF as stored (without `--model`, or `--gguf FILE`): the file's quantized blocks (the default's
  Q4_1: the int4 kernels); a user with a GGUF embeds from it.

Texts: `--num-texts` random sentences per case, short (16-64 tokens) and long (256-512), fresh ones in every run
(distinct from their first word: no prefix-cache hits, every engine with its defaults). Each case's first run warms
every engine up (inferno's background warm-up is awaited before), then the engines take turns, `--repeats` runs
each; the table has each one's median wall and CPU time (the process's, all threads: on a shared machine the
fairer ratio), and the smallest cosine between its vectors and sentence-transformers'.

`--profile` adds where each engine's time goes (torch.profiler over one run per case, operators' self time): the
matrix products (`aten::mm` / `addmm` / `bmm` and inferno's quantized `*_matmul` kernels), attention, the rest.
The float GEMM is the same operator with the same rows in sentence-transformers and in inferno on a float folder,
so its share of inferno's time bounds what any engine can gain on that folder.

    python benchmarks/embeddings.py [--model FOLDER] [--gguf FILE] [--threads N] [--quantization int8] [--profile]
"""
import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from results_md import write_section

WORDS = ("the model reads every token of a prompt and pools its hidden states into one vector that retrieval "
         "systems compare by cosine similarity across documents queries passages and questions about weather "
         "history science cooking travel music software engines kernels caches batches threads").split()
CASES = {"short": (16, 64), "long": (256, 512)}
MIN_COSINE = 0.99  # below it an engine's vectors are wrong, not rounded (bfloat16 keeps > 0.999)


def make_st_folder(folder: Path, gguf: Path) -> Path:
    """`gguf` as a sentence-transformers folder: HF float32 weights, last-token pooling, Normalize."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = folder / "hf"
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model does not save: copy it into a plain one
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(hf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.chat_template = None  # with one, sentence-transformers 6 would embed each text as a chat message
    tokenizer.save_pretrained(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import models
    transformer = models.Transformer(str(hf))
    pooling = models.Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    st_model(modules=[transformer, pooling, models.Normalize()]).save(str(folder / "st"))
    return folder / "st"


def st_model(**kwargs):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(device="cpu", **kwargs)


def make_texts(tokenizer, count: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """`count` texts of `min_tokens`..`max_tokens` tokens, each starting with its own "<seed>.<i>"."""
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        target = rng.randint(min_tokens, max_tokens)
        words = [f"{seed}.{i}"]
        while len(tokenizer.encode(" ".join(words))) < target:
            words += rng.choices(WORDS, k=4)
        texts.append(" ".join(words))
    return texts


@dataclass
class Engine:
    name: str
    runs: str  # what it computes with, for the table
    embed: Callable[[list[str]], torch.Tensor]  # the texts' vectors, float32 [texts, hidden]
    seconds: dict[str, list[float]] = field(default_factory=dict)  # per case
    cpu_seconds: dict[str, list[float]] = field(default_factory=dict)
    tokens_per_s: dict[str, list[float]] = field(default_factory=dict)
    min_cosine: dict[str, float] = field(default_factory=dict)
    time_shares: dict[str, dict[str, float]] = field(default_factory=dict)  # per case, --profile: per kind


def sentence_transformers_engine(model, batch_size: int) -> Engine:
    return Engine("sentence-transformers `encode()`", f"float32 weights, batches of {batch_size} padded",
                  lambda texts: model.encode(texts, batch_size=batch_size, convert_to_tensor=True).float())


def inferno_engine(model: str, name: str, threads: int, quantization: str | None = "auto") -> Engine:
    """`LLM(model, runner="pooling")` with its defaults but the threads (and `quantization`), warmed up: one embed
    call, then its background warm-up (weights regrouped into tiles, moved onto huge pages) awaited."""
    from inferno import LLM
    llm = LLM(model=model, runner="pooling", num_threads=threads, quantization=quantization)

    def embed(texts: list[str]) -> torch.Tensor:
        return torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    embed(["a first text to warm up with", "and a second one"])
    llm.wait_for_warm_up()
    config = llm.llm_engine.config
    weights = "weights as stored" if quantization == "auto" else f"{quantization} weights"
    return Engine(name, f"{config.dtype}, {weights}, {config.max_num_batched_tokens} tokens per step", embed)


def measure(engines: list[Engine], tokenizer, args: argparse.Namespace) -> dict[str, int]:
    """Every case: each engine warmed on it once, then `--repeats` rounds in which the engines take turns on the
    round's fresh texts; returns each case's mean token count per run."""
    tokens = {}
    for case, (low, high) in CASES.items():
        counts = []
        for run in range(args.repeats + 1):
            texts = make_texts(tokenizer, args.num_texts, low, high, seed=run)
            num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
            counts.append(num_tokens)
            reference, times = None, []
            for engine in engines:
                start, cpu_start = time.perf_counter(), time.process_time()
                vectors = engine.embed(texts)
                seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
                if reference is None:
                    reference = vectors
                engine.min_cosine[case] = min(engine.min_cosine.get(case, 1.0), F.cosine_similarity(
                    vectors.double(), reference.double(), dim=-1).min().item())
                if run:  # run 0 warms up
                    engine.seconds.setdefault(case, []).append(seconds)
                    engine.cpu_seconds.setdefault(case, []).append(cpu_seconds)
                    engine.tokens_per_s.setdefault(case, []).append(num_tokens / seconds)
                times.append(f"{engine.name} {seconds:.2f} s ({cpu_seconds:.2f} s CPU)")
            print(f"{case} run {run}{' (warm-up)' if run == 0 else ''}: {', '.join(times)}", flush=True)
            if args.profile and run == 1:
                for engine in engines:
                    engine.time_shares[case] = time_shares(engine, texts)
        tokens[case] = round(statistics.mean(counts))
    return tokens


def operator_kind(name: str) -> str:
    """What an operator of the profile computes: "GEMM" (float or quantized matrix products), "attention", "rest"."""
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int8pack_mm") or (
            name.startswith("inferno::") and name.endswith("matmul")):
        return "GEMM"
    if "attention" in name:
        return "attention"
    return "rest"


def time_shares(engine: Engine, texts: list[str]) -> dict[str, float]:
    """The shares of one embed of `texts` by `engine` (its wall time under the profiler) spent in the GEMM and
    attention operators (self times, on the calling thread); "rest": everything else, Python included."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.embed(texts)
        wall_us = (time.perf_counter() - start) * 1e6
    totals = {"GEMM": 0.0, "attention": 0.0}
    for event in prof.key_averages():
        kind = operator_kind(event.key)
        if kind in totals:
            totals[kind] += event.self_cpu_time_total
    shares = {kind: total / wall_us for kind, total in totals.items()}
    return {**shares, "rest": 1 - sum(shares.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a sentence-transformers folder (default: the default GGUF saved as one)")
    parser.add_argument("--gguf", help="a GGUF file of the same weights, embedded as stored (default: the default "
                        "model's, when --model is not given)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--quantization", choices=["int8", "int4", "w8a8"],
                        help="add inferno on the folder with these weights")
    parser.add_argument("--num-texts", type=int, default=128, help="texts per case and run")
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode() batch size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="also where each engine's time goes (a profiled run per case)")
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from inferno.loader.model_loader import default_model_path
    gguf = args.gguf or (None if args.model else default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else make_st_folder(Path(tmp), Path(gguf))
        oracle = st_model(model_name_or_path=str(folder), model_kwargs={"dtype": torch.float32})
        engines = [sentence_transformers_engine(oracle, args.batch_size),
                   inferno_engine(str(folder), "inferno `LLM.embed`, the folder", args.threads)]
        if args.quantization:
            engines.append(inferno_engine(str(folder), f"inferno `LLM.embed`, the folder, {args.quantization}",
                                          args.threads, args.quantization))
        if gguf:
            engines.append(inferno_engine(gguf, f"inferno `LLM.embed`, {Path(gguf).name}", args.threads))
        tokens = measure(engines, oracle.tokenizer, args)
    report(args, folder if args.model else f"{Path(gguf).name} saved as a float32 sentence-transformers folder",
           engines, tokens)


def report(args: argparse.Namespace, model: str, engines: list[Engine], tokens: dict[str, int]) -> None:
    command = (f"python benchmarks/embeddings.py --threads {args.threads} --num-texts {args.num_texts} --repeats "
               f"{args.repeats}" + "".join(f" --{name} {getattr(args, name)}" for name in ("model", "gguf",
                                                                                              "quantization")
                                           if getattr(args, name)) + (" --profile" if args.profile else ""))
    lines = ["## Embeddings throughput (`benchmarks/embeddings.py`)", "",
             f"- Command: `{command}`",
             f"- Model: {model}; last-token pooling, normalized; {args.threads} threads for every engine",
             f"- Texts: {args.num_texts} per run, fresh ones each run; medians of {args.repeats} runs, the engines "
             "taking turns, each warmed up first", ""]
    st = engines[0]
    for case, (low, high) in CASES.items():
        lines += [f"{case.capitalize()} texts, {low}-{high} tokens ({tokens[case]} tokens per run):", "",
                  "| engine | runs | seconds | CPU seconds | texts/s | tokens/s | × sentence-transformers | "
                  "× by CPU time | min cosine |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        st_seconds, st_cpu = statistics.median(st.seconds[case]), statistics.median(st.cpu_seconds[case])
        for e in engines:
            seconds, cpu = statistics.median(e.seconds[case]), statistics.median(e.cpu_seconds[case])
            tps = statistics.median(e.tokens_per_s[case])
            cosine = "–" if e is st else f"{e.min_cosine[case]:.6f}"
            lines.append(f"| {e.name} | {e.runs} | {seconds:.2f} | {cpu:.2f} | {args.num_texts / seconds:.1f} | "
                         f"{tps:.0f} | **{st_seconds / seconds:.2f}×** | {st_cpu / cpu:.2f}× | {cosine} |")
        lines.append("")
        if args.profile:
            lines += [f"Where the time goes ({case} texts, one profiled run: operators' self time over the run's "
                      "wall time):", "", "| engine | GEMM | attention | the rest |", "| --- | ---: | ---: | ---: |"]
            lines += [f"| {e.name} | {e.time_shares[case]['GEMM']:.0%} | {e.time_shares[case]['attention']:.0%} | "
                      f"{e.time_shares[case]['rest']:.0%} |" for e in engines]
            lines.append("")
    body = "\n".join(lines)
    print(body)
    wrong = [f"{e.name} ({case}: {e.min_cosine[case]:.4f})" for e in engines[1:] for case in CASES
             if e.min_cosine[case] < MIN_COSINE]
    if wrong:  # a speed of wrong vectors is no result: say so, leave RESULTS.md as it was
        sys.exit(f"vectors far from sentence-transformers' (min cosine below {MIN_COSINE}): {', '.join(wrong)}")
    write_section(args.results, "embeddings", body)


if __name__ == "__main__":
    sys.exit(main())
