"""Time to load a GGUF model: open the file (metadata, vocabulary, tensor index) -> config, tokenizer, and the
whole `load_model` per quantization, medians of --repeat runs in this process (the file in the page cache).
`--gguf-reader` also times `gguf.GGUFReader` (the previous loader's first step) for comparison.

    python benchmarks/gguf_load.py --model models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --quantization auto none
"""
import argparse
import statistics
import time
from collections.abc import Callable

import torch

from inferno.loader import gguf as gguf_loader
from inferno.loader.model_loader import default_model_path, load_model
from inferno.loader.tokenizer import Tokenizer


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--quantization", nargs="+", default=["auto", "none"], choices=["auto", "none", "int4", "int8"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--gguf-reader", action="store_true", help="also time gguf.GGUFReader on the file")
    args = p.parse_args()
    torch.set_num_threads(args.num_threads)
    path = args.model or default_model_path()
    gguf_file = gguf_loader.open_gguf(path)
    rows = [("open: metadata + vocabulary + tensor index", median_seconds(lambda: gguf_loader.open_gguf(path),
                                                                           args.repeat)),
            ("config", median_seconds(lambda: gguf_loader.read_config(gguf_loader.open_gguf(path)), args.repeat)),
            ("tokenizer (from the open file)", median_seconds(lambda: Tokenizer.from_gguf(gguf_file), args.repeat))]
    if args.gguf_reader:
        import gguf
        rows.append(("gguf.GGUFReader (before)", median_seconds(lambda: gguf.GGUFReader(path), 1)))
    for quantization in args.quantization:
        value = None if quantization == "none" else quantization
        rows.append((f"load_model quantization={quantization}",
                     median_seconds(lambda: load_model(path, torch.float32, quantization=value), args.repeat)))
    print(f"{path}: {len(gguf_file.tensors)} tensors, {len(gguf_file.field('tokenizer.ggml.tokens', []))} tokens")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} s |")


if __name__ == "__main__":
    main()
