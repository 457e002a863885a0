"""Quality of reduced-precision configurations against the float32 model on the same weights.

Every configuration reads the same fixed texts (QUALITY_TEXTS) teacher-forced through the engine's model and
paged KV cache, in prefill chunks of --chunk tokens (so later chunks read earlier K/V back from the cache, which
is what a quantized KV cache changes). Per configuration, over all next-token positions of all texts:
- mean KL(float32 || config) of the next-token distributions (nats),
- top-1 agreement: the share of positions where both pick the same most likely token,
- perplexity of the texts themselves (the reference's own perplexity is in the float32 row).
Results print as a table and replace the `quality` section of --output.
"""
import argparse
import gc
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from inferno import LLM
from inferno.engine.llm_engine import LLMEngine
from inferno.layers.quantization.native import QuantizedEmbedding
from inferno.layers.quantization.q6_k import Q6KEmbedding
from inferno.layers.quantization.super_blocks import SuperBlockLinear
from inferno.layers.quantization.int4 import Int4Linear
from inferno.layers.quantization.q8 import Q8Linear
from inferno.loader import gguf as gguf_loader
from inferno.request import Request
from inferno.sampling_params import SamplingParams
from results_md import write_section  # benchmarks/results_md.py (scripts run from this folder)

QUALITY_TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press into a system that could produce books far faster than "
    "scribes. Within fifty years, presses were running in more than two hundred European cities, and the price of "
    "books fell so sharply that reading spread from monasteries and universities to merchants and artisans.",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
    "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
    "        if items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
    "    return -1\n\n\ndef test_binary_search():\n    assert binary_search([1, 3, 5, 7], 5) == 2\n"
    "    assert binary_search([1, 3, 5, 7], 4) == -1\n",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light energy into chemical "
    "energy. In the chloroplasts, chlorophyll absorbs mostly blue and red light; the energy splits water molecules, "
    "releasing oxygen, and drives the synthesis of ATP and NADPH, which the Calvin cycle then uses to fix carbon "
    "dioxide into sugars. Nearly all the oxygen in the atmosphere comes from this process.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat are three good habits for "
    "staying healthy?<|im_end|>\n<|im_start|>assistant\nHere are three habits that help most people stay healthy:\n"
    "1. Sleep seven to nine hours a night at regular times.\n2. Move every day: walking, cycling or any exercise "
    "you enjoy.\n3. Eat mostly whole foods, with plenty of vegetables, fruit and water.<|im_end|>\n",
    "To make a simple tomato sauce, warm two tablespoons of olive oil in a pan over medium heat. Add a chopped "
    "onion and cook it slowly until soft and golden, about ten minutes. Stir in two cloves of garlic, then a can "
    "of crushed tomatoes, a pinch of salt and a few basil leaves. Let the sauce simmer for twenty minutes, "
    "stirring now and then, and season it to taste before serving it over pasta.",
    "The Moon orbits the Earth at an average distance of about 384,400 kilometres and always shows the same face "
    "to us, because its rotation period equals its orbital period. Its gravity raises the ocean tides, and over "
    "billions of years the tidal friction has slowed the Earth's rotation and pushed the Moon slowly outward, by "
    "a few centimetres every year.",
]


@dataclass(slots=True)
class Configuration:
    name: str
    engine_args: dict
    native_types: tuple[str, ...] | None = None  # quantization="auto": only these GGUF types run as stored


# the GGUF file's weights dequantized to float32, float32 KV cache
FLOAT32 = {"dtype": "float32", "quantization": None, "kv_cache_dtype": "float32"}
AUTO = {"dtype": "float32", "quantization": "auto"}  # (float16 KV cache, the default under float32)
GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


CONFIGURATIONS = {
    "float32": Configuration("float32", FLOAT32),
    "default": Configuration("the defaults (no options)", {}),
    "bfloat16": Configuration("bfloat16", {"dtype": "bfloat16", "quantization": None}),
    "auto": Configuration("GGUF blocks as stored (quantization=auto, the default)", AUTO),
    **{f"auto-{t}": Configuration(f"{t} blocks as stored, the rest float32", AUTO, (t,)) for t in GGUF_TYPES},
    "int8": Configuration("int8 weights, group 32 (float32 activations)", {"quantization": "int8"}),
    "int8-g64": Configuration("int8 weights, group 64 (float32 activations)",
                              {"quantization": "int8", "quantization_group_size": 64}),
    "int8-channel": Configuration("int8 weights per output channel (bf16 activations)",
                                  {"quantization": "int8", "quantization_group_size": -1}),
    "int8-channel-fp32": Configuration("int8 weights per output channel, float32 between the matmuls",
                                       {"quantization": "int8", "quantization_group_size": -1, "dtype": "float32"}),
    "int4-g32": Configuration("int4 weights, group 32", {"quantization": "int4", "quantization_group_size": 32}),
    "int4-g64": Configuration("int4 weights, group 64", {"quantization": "int4", "quantization_group_size": 64}),
    "int4-g128": Configuration("int4 weights, group 128", {"quantization": "int4", "quantization_group_size": 128}),
    "kv-fp16": Configuration("float32, float16 KV cache", {**FLOAT32, "kv_cache_dtype": "float16"}),
    "kv-int8": Configuration("float32, int8 KV cache", {**FLOAT32, "kv_cache_dtype": "int8"}),
    "kv-fp8": Configuration("float32, fp8 (e4m3) KV cache", {**FLOAT32, "kv_cache_dtype": "fp8_e4m3"}),
    "int4-g32-kv-int8": Configuration("int4 weights (group 32) + int8 KV cache",
                                      {"quantization": "int4", "kv_cache_dtype": "int8"}),
}


@dataclass(slots=True)
class Quality:
    name: str
    positions: int
    mean_kl: float
    top1_agreement: float
    perplexity: float


@torch.inference_mode()
def teacher_forced_logprobs(engine: LLMEngine, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Next-token log-probabilities [len - 1, vocab] of one text, fed in prefill chunks through the KV cache."""
    runner = engine.model_runner
    block_size = engine.config.block_size
    req = Request("quality", token_ids, SamplingParams(), set(), engine.max_model_len)
    assert engine.kv_cache_manager.allocate_slots(req, len(token_ids)), "KV cache too small for the text"
    try:
        logits = []
        for start in range(0, len(token_ids), chunk):
            end = min(start + chunk, len(token_ids))
            slots = [req.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
            meta = runner.attention.build_metadata(slots, [], [(end - start, start, req.block_ids)])
            hidden = runner.model(torch.tensor(token_ids[start:end]), torch.arange(start, end), meta)
            logits.append(runner.model.compute_logits(hidden))
        return torch.cat(logits)[:-1].log_softmax(dim=-1)
    finally:
        engine.kv_cache_manager.free(req)


@contextmanager
def native_types_only(types: tuple[str, ...] | None) -> Iterator[None]:
    """While loading: GGUF tensors of other types than `types` become float (a fused layer runs natively only when
    all its shards are of these types)."""
    if types is None:
        yield
        return
    native_weight = gguf_loader.native_weight
    gguf_loader.native_weight = lambda tensor, name, native, tied=True: (
        native_weight(tensor, name, native, tied) if tensor.tensor_type.name in types else None)
    try:
        yield
    finally:
        gguf_loader.native_weight = native_weight


def runs_natively(engine: LLMEngine) -> bool:
    native = (Int4Linear, SuperBlockLinear, Q8Linear, QuantizedEmbedding, Q6KEmbedding)
    return any(isinstance(m, native) for m in engine.model_runner.model.modules())


def evaluate(engine: LLMEngine, texts: list[list[int]], chunk: int) -> list[torch.Tensor]:
    return [teacher_forced_logprobs(engine, ids, chunk) for ids in texts]


def llamacpp_logprobs(model_path: str, texts: list[list[int]], chunk: int, num_threads: int) -> list[torch.Tensor]:
    """llama.cpp (llama-cpp-python) on the same GGUF file and the same token ids, in batches of `chunk` tokens:
    its next-token log-probabilities per text, as `teacher_forced_logprobs` gives ours."""
    from llama_cpp import Llama
    llm = Llama(model_path=model_path, n_ctx=max(map(len, texts)) + 1, n_batch=chunk, n_ubatch=chunk,
                n_threads=num_threads, n_threads_batch=num_threads, logits_all=True, verbose=False)
    out = []
    for ids in texts:
        llm.reset()
        llm.eval(ids)
        out.append(torch.from_numpy(llm.scores[:len(ids) - 1].copy()).log_softmax(dim=-1))
    return out


def compare(name: str, ref: list[torch.Tensor], ours: list[torch.Tensor], texts: list[list[int]]) -> Quality:
    ref_all, ours_all = torch.cat(ref), torch.cat(ours)
    kl = (ref_all.exp() * (ref_all - ours_all)).sum(dim=-1)
    agree = (ref_all.argmax(dim=-1) == ours_all.argmax(dim=-1)).float()
    targets = torch.cat([torch.tensor(ids[1:]) for ids in texts])
    nll = -ours_all.gather(1, targets.unsqueeze(1)).squeeze(1)
    return Quality(name, len(targets), kl.mean().item(), agree.mean().item(), nll.mean().exp().item())


def report(args: argparse.Namespace, model_path: str, results: list[Quality]) -> str:
    lines = ["## Quality vs float32 (`benchmarks/quality.py`)", "",
             f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- Command: `{shlex.join(['python', sys.argv[0], *sys.argv[1:]])}`",
             f"- Model: `{Path(model_path).name}`; reference: the same file dequantized to float32",
             f"- Texts: {len(QUALITY_TEXTS)} fixed texts (prose, code, chat, recipe), {results[0].positions} "
             f"next-token positions, fed in chunks of {args.chunk} tokens through the paged KV cache",
             "", "| configuration | mean KL (nats) | top-1 agreement | perplexity |", "|---|---:|---:|---:|"]
    lines += [f"| {r.name} | {max(r.mean_kl, 0.0):.5f} | {r.top1_agreement:.2%} | {r.perplexity:.3f} |" for r in results]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGURATIONS), choices=list(CONFIGURATIONS))
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk length (tokens)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--llamacpp", action="store_true", help="add a row for llama.cpp (llama-cpp-python) on the file")
    p.add_argument("--output", default=str(Path(__file__).with_name("RESULTS.md")), help="'' to skip")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.num_threads)
    reference, texts, results, model_path = None, None, [], ""
    for key in ["float32", *[c for c in args.configs if c != "float32"]]:
        config = CONFIGURATIONS[key]
        with native_types_only(config.native_types):
            llm = LLM(model=args.model, kv_cache_memory=64 << 20, num_threads=args.num_threads, **config.engine_args)
        if config.native_types and not runs_natively(llm.llm_engine):
            print(f"skipped {key}: no layer of the model runs natively with it")
            continue
        model_path = llm.llm_engine.model_path
        texts = texts or [llm.get_tokenizer().encode(t) for t in QUALITY_TEXTS]
        logprobs = evaluate(llm.llm_engine, texts, args.chunk)
        reference = reference or logprobs
        results.append(compare(config.name, reference, logprobs, texts))
        print(results[-1], flush=True)
        del llm
        gc.collect()
    if args.llamacpp:
        logprobs = llamacpp_logprobs(model_path, texts, args.chunk, args.num_threads)
        results.append(compare("llama.cpp on the same file (llama-cpp-python)", reference, logprobs, texts))
        print(results[-1], flush=True)
    body = report(args, model_path, results)
    print("\n" + body)
    if args.output:
        write_section(Path(args.output), "quality", body)
        print(f"updated {args.output}")


if __name__ == "__main__":
    main()
