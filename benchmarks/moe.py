"""Mixture-of-experts decode: inferno against HF transformers on the same random OLMoE-shaped weights, and the
batch-1 decode step against its memory-bandwidth floor.

Model: OLMoE-1B-7B's layer shapes (hidden 2048, 16 heads of 128, 64 experts of inner size 1024, 8 per token,
vocabulary 50304) with --layers layers, random weights (HF's init), saved as an HF folder that both engines load.

- batch-1 decode: a --prompt-len token prompt, --output new tokens, median of --repeats. inferno: (output - 1) /
  (finished_time - first_token_time); HF: (output - 1) / (wall time of generate(output) - generate(1)).
- offline throughput: --num-prompts prompts of --prompt-len tokens, --output new tokens each (ignore_eos). inferno:
  one `LLM.generate` call; HF: one padded batch `generate()`. Output tok/s.
- floor: the bytes a batch-1 decode step must read — every layer's attention projections and router, the 8 chosen
  experts' gate/up/down, the final norm and LM head — divided by the memory bandwidth measured here (the best of
  several sums over a 1 GiB tensor, all threads).
The machine is shared: numbers move with the other load on it.
"""
import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from inferno import LLM, SamplingParams

OLMOE = dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16,
             num_experts=64, num_experts_per_tok=8, vocab_size=50304, max_position_embeddings=4096,
             pad_token_id=0, eos_token_id=1, tie_word_embeddings=False)


def write_model(folder: Path, layers: int) -> torch.nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM
    torch.manual_seed(0)
    model = OlmoeForCausalLM(OlmoeConfig(num_hidden_layers=layers, **OLMOE)).eval()
    model.save_pretrained(folder)
    tokens = {chr(0x100 + i): i for i in range(256)}  # any tokenizer will do: prompts are token ids
    tokenizer = Tokenizer(models.BPE(tokens, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.save(str(folder / "tokenizer.json"))
    return model


def memory_bandwidth() -> float:
    """Bytes per second read by a multi-threaded sum over 1 GiB (best of 5)."""
    x = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best


def decode_step_bytes(layers: int, element_size: float) -> float:
    h, i, k, v = OLMOE["hidden_size"], OLMOE["intermediate_size"], OLMOE["num_experts_per_tok"], OLMOE["vocab_size"]
    per_layer = 4 * h * h + OLMOE["num_experts"] * h + k * 3 * h * i
    return (layers * per_layer + v * h) * element_size


def inferno_decode(llm: LLM, prompt: list[int], output: int) -> float:
    params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    return (output - 1) / (out.metrics.finished_time - out.metrics.first_token_time)


@torch.inference_mode()
def hf_decode(model, prompt: list[int], output: int) -> float:
    ids = torch.tensor([prompt])

    def run(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - start
    return (output - 1) / (run(output) - run(1))


@torch.inference_mode()
def hf_throughput(model, prompts: list[list[int]], output: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output, min_new_tokens=output,
                   do_sample=False, pad_token_id=0)
    return len(prompts) * output / (time.perf_counter() - start)


def inferno_throughput(llm: LLM, prompts: list[list[int]], output: int) -> float:
    params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return len(prompts) * output / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", default=None, help="also run inferno with int8 / int4 weights")
    args = p.parse_args()
    torch.manual_seed(0)
    prompt = torch.randint(2, 256, (args.prompt_len,)).tolist()
    prompts = torch.randint(2, 256, (args.num_prompts, args.prompt_len)).tolist()
    results = {"command": "python benchmarks/moe.py " + shlex.join(sys.argv[1:]), "threads": torch.get_num_threads()}
    bandwidth = memory_bandwidth()
    results["bandwidth_GBps"] = bandwidth / 1e9
    results["floor_ms_float32"] = decode_step_bytes(args.layers, 4) / bandwidth * 1e3
    with tempfile.TemporaryDirectory() as folder:
        hf_model = write_model(Path(folder), args.layers)
        hf_decode(hf_model, prompt, 4)  # warm-up
        results["hf_decode_tok_s"] = statistics.median(hf_decode(hf_model, prompt, args.output)
                                                       for _ in range(args.repeats))
        results["hf_throughput_tok_s"] = hf_throughput(hf_model, prompts, args.output)
        del hf_model
        runs = [("float32", None)] + ([(args.quantization, args.quantization)] if args.quantization else [])
        for name, quantization in runs:
            llm = LLM(model=folder, dtype="float32", quantization=quantization, kv_cache_memory=256 << 20,
                      enforce_eager=True)
            inferno_decode(llm, prompt, 4)  # warm-up
            tok_s = statistics.median(inferno_decode(llm, prompt, args.output) for _ in range(args.repeats))
            results[f"inferno_{name}_decode_tok_s"] = tok_s
            results[f"inferno_{name}_decode_step_ms"] = 1e3 / tok_s
            results[f"inferno_{name}_throughput_tok_s"] = inferno_throughput(llm, prompts, args.output)
            del llm
    results["float32_step_vs_floor"] = results["inferno_float32_decode_step_ms"] / results["floor_ms_float32"]
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
