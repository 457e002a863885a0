"""The LoRA product of one projection (inferno/layers/lora.py), four ways, by token rows and adapters in the batch:
native (kernels/lora_bgmv.cpp: the rows grouped per slot, only the slots in use read: what CPU decode steps and the
compiled graph run), masked (every slot's shrink for every row, the other slots zeroed, one expand: the PyTorch path
of those steps, without the native kernels or on a GPU), segmented (per adapter, its rows through its own A and B:
what prefill steps run above SEGMENTED_FROM_ROWS rows) and gathered (each row's A and B gathered, then two batched
matrix-vector products: punica's BGMV shape in PyTorch, for comparison). The shapes are SmolLM2-135M's fused q/k/v
projection (576 -> 576 + 192 + 192), gate/up (576 -> 1536 + 1536) and down projection (1536 -> 576), rank 16,
float32.

    python lora_kernels.py --threads 2 --max-loras 4
"""
import argparse
import time

import torch

from inferno.kernels import native_ops
from inferno.layers.lora import LoRAMapping, LoRAStack

PROJECTIONS = {"qkv": (576, [576, 192, 192]), "gate_up": (576, [1536, 1536]), "down": (1536, [576])}


def gathered(stack: LoRAStack, x: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    a, b = stack.lora_a[token_slots], stack.lora_b[token_slots]  # [T, width, in], [T, width, out]
    return torch.bmm(torch.bmm(a, x[:, :, None]).transpose(1, 2), b)[:, 0]


def timed(fn, repeats: int) -> float:
    """The fastest of `repeats` runs (microseconds): the least disturbed by other processes."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, max_loras {args.max_loras}, rank {args.rank}; "
          "microseconds per product (fastest run)")
    ops = native_ops()
    print(f"{'projection':>10} {'rows':>5} {'adapters':>8} {'native':>9} {'masked':>9} {'segmented':>9} "
          f"{'gathered':>9}")
    for name, (in_features, slices) in PROJECTIONS.items():
        stack = LoRAStack(in_features, slices, args.max_loras + 1, args.rank, torch.float32, torch.device("cpu"))
        stack.lora_a.normal_()
        stack.lora_b.normal_()
        for rows in (1, 4, 16, 64, 256, 1024):
            for adapters in sorted({1, min(args.max_loras, rows)}):
                x = torch.randn(rows, in_features)
                slots = [1 + i * adapters // rows for i in range(rows)]  # contiguous segments, as a batch lays them
                token_slots = torch.tensor(slots)
                segments = LoRAMapping(token_slots, [(s, (token_slots == s).nonzero().squeeze(1))
                                                     for s in sorted(set(slots))]).segments
                with torch.inference_mode():
                    native = float("nan") if ops is None else timed(
                        lambda: stack._native(ops, x, token_slots), args.repeats)
                    times = [native, timed(lambda: stack._masked(x, token_slots), args.repeats),
                             timed(lambda: stack._segmented(x, segments), args.repeats),
                             timed(lambda: gathered(stack, x, token_slots), args.repeats)]
                print(f"{name:>10} {rows:>5} {adapters:>8} " + " ".join(f"{t:>9.1f}" for t in times))


if __name__ == "__main__":
    main()
