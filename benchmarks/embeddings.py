"""Embeddings throughput: inferno's `LLM.embed` against sentence-transformers' `encode()` on the same model, dtype
and threads.

The model is a sentence-transformers folder (last-token pooling, normalized: Qwen3-Embedding's recipe): `--model`
names one (any folder of an architecture inferno runs, e.g. Qwen/Qwen3-Embedding-0.6B), else the default model's
weights (SmolLM2-135M, read from its GGUF by transformers) are saved as one. The texts: `--num-texts` random
sentences of `--min-tokens`..`--max-tokens` tokens, distinct from their first words (no prefix-cache hits).
Each side embeds them once to warm up, then `--repeats` times; the table has the best run of each (prompts/s and
tokens/s), the speedup, and the smallest cosine between the two sides' vectors (near 1 when both embedded the same
tokens: sentence-transformers 6 wraps each text in the chat template of a tokenizer that has one, inferno does not).

    python benchmarks/embeddings.py [--model FOLDER] [--threads N] [--dtype float32] [--quantization int8]
"""
import argparse
import os
import platform
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from results_md import write_section

WORDS = ("the model reads every token of a prompt and pools its hidden states into one vector that retrieval "
         "systems compare by cosine similarity across documents queries passages and questions about weather "
         "history science cooking travel music software engines kernels caches batches threads").split()


def make_st_folder(folder: Path) -> Path:
    """The default model as a sentence-transformers folder: HF weights, last-token pooling, Normalize."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from inferno.loader.model_loader import default_model_path
    gguf = Path(default_model_path())
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
    st_models = sentence_transformers_models()
    transformer = st_models.Transformer(str(hf))
    pooling = st_models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="lasttoken")
    st_model(modules=[transformer, pooling, st_models.Normalize()]).save(str(folder / "st"))
    return folder / "st"


def sentence_transformers_models():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import models
    return models


def st_model(**kwargs):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(device="cpu", **kwargs)


def make_texts(tokenizer, count: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        target = rng.randint(min_tokens, max_tokens)
        words = [str(i)]
        while len(tokenizer.encode(" ".join(words))) < target:
            words += rng.choices(WORDS, k=8)
        texts.append(" ".join(words))
    return texts


def best_time(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a sentence-transformers folder (default: SmolLM2-135M saved as one)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", choices=["int8", "int4", "w8a8"],
                        help="inferno's weights (default: float, as sentence-transformers runs them)")
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--min-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode() batch size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else make_st_folder(Path(tmp))
        dtype = getattr(torch, args.dtype)
        oracle = st_model(model_name_or_path=str(folder), model_kwargs={"dtype": dtype})
        texts = make_texts(oracle.tokenizer, args.num_texts, args.min_tokens, args.max_tokens)
        num_tokens = sum(len(oracle.tokenizer.encode(t)) for t in texts)

        def st_run():
            return oracle.encode(texts, batch_size=args.batch_size, convert_to_tensor=True)
        st_seconds = best_time(st_run, args.repeats)
        st_vectors = st_run().float()
        del oracle

        from inferno import LLM
        llm = LLM(model=str(folder), runner="pooling", dtype=args.dtype, num_threads=args.threads,
                  quantization=args.quantization, enable_prefix_caching=False)

        def inferno_run():
            return llm.embed(texts, use_tqdm=False)
        inferno_seconds = best_time(inferno_run, args.repeats)
        vectors = torch.tensor([o.outputs.embedding for o in inferno_run()])
    min_cosine = F.cosine_similarity(vectors.double(), st_vectors.double(), dim=-1).min().item()
    report(args, folder if args.model else "SmolLM2-135M-Instruct (HF float, as a sentence-transformers folder)",
           num_tokens, st_seconds, inferno_seconds, min_cosine)


def report(args, model, num_tokens: int, st_seconds: float, inferno_seconds: float, min_cosine: float) -> None:
    n = args.num_texts
    weights = f", {args.quantization} weights" if args.quantization else ""
    rows = [("sentence-transformers encode()", st_seconds), (f"inferno LLM.embed{weights}", inferno_seconds)]
    table = ["| engine | seconds | prompts/s | tokens/s |", "| --- | --- | --- | --- |"]
    table += [f"| {name} | {s:.2f} | {n / s:.1f} | {num_tokens / s:.0f} |" for name, s in rows]
    body = "\n".join([
        "## Embeddings throughput",
        "",
        f"`python benchmarks/embeddings.py --threads {args.threads} --dtype {args.dtype}"
        f"{f' --quantization {args.quantization}' if args.quantization else ''}` on {platform.machine()} "
        f"({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}: {model}, {n} texts of {args.min_tokens}.."
        f"{args.max_tokens} tokens ({num_tokens} in all), last-token pooling, normalized; best of {args.repeats}.",
        "",
        *table,
        "",
        f"inferno / sentence-transformers: **{st_seconds / inferno_seconds:.2f}x**; smallest cosine between their "
        f"vectors {min_cosine:.6f}.",
    ])
    print(body)
    write_section(args.results, "embeddings", body)


if __name__ == "__main__":
    sys.exit(main())
