"""Does a greedy request's output depend on the batch? Each prompt alone (the first one is the engine's first pass),
then all of them in one batch, in the given order and reversed, under a small token budget (--budget) so that the
long prompts are chunked at other places alone than batched. Per prompt and batch: whether the tokens are equal,
the first position where they differ, and the largest difference of the chosen tokens' log-probabilities over the
positions before it (0.0 means the same bits).

    python benchmarks/batch_invariance.py                      # the default model (SmolLM2-135M Q4_1)
    python benchmarks/batch_invariance.py --model /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

Exits with status 1 when any prompt differs."""
import argparse
import sys

from inferno import LLM, SamplingParams

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A long time ago, in a small village by the sea, there lived an old fisherman who told stories about the storms "
    "he had seen, the fish he had caught and the friends he had lost. ",
    "Three facts about the Moon:\n1.",
    "Translate to French: the weather is nice today and we are going to the beach with our friends.",
    "List the planets of the solar system in order from the Sun:",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id GROUP BY",
]


def prompts(llm: LLM, long_repeats: int) -> list[list[int]]:
    """The texts' tokens; the third repeated `long_repeats` times (a prompt past the budget, whose decode attention
    the kernel splits over threads when it runs alone)."""
    tok = llm.get_tokenizer()
    ids = [tok.encode(text) for text in TEXTS]
    ids[2] = ids[2] * long_repeats
    return ids


def run(llm: LLM, batch: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [position[t].logprob for t, position in zip(o.outputs[0].token_ids,
                                                                                 o.outputs[0].logprobs)])
            for o in outs]


def compare(alone: tuple[list[int], list[float]], batched: tuple[list[int], list[float]]) -> tuple[int | None, float]:
    """The first position where the tokens differ (None: none) and the largest log-probability difference before it."""
    tokens, logprobs = alone
    other_tokens, other_logprobs = batched
    first = next((i for i, (a, b) in enumerate(zip(tokens, other_tokens)) if a != b), None)
    upto = len(tokens) if first is None else first + 1
    return first, max(abs(a - b) for a, b in zip(logprobs[:upto], other_logprobs[:upto]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or model folder (default: the default model)")
    parser.add_argument("--budget", type=int, default=128, help="max_num_batched_tokens")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--long-repeats", type=int, default=8, help="repeats of the long prompt's text")
    args = parser.parse_args()
    llm = LLM(args.model, max_num_batched_tokens=args.budget, kv_cache_memory=256 << 20)
    ids = prompts(llm, args.long_repeats)
    print(f"prompts of {[len(p) for p in ids]} tokens, budget {args.budget} tokens per step")
    alone = [run(llm, [p], args.max_tokens)[0] for p in ids]
    differ = 0
    for name, order in (("batched", list(range(len(ids)))), ("reversed", list(reversed(range(len(ids)))))):
        for i, result in zip(order, run(llm, [ids[i] for i in order], args.max_tokens)):
            first, delta = compare(alone[i], result)
            differ += first is not None or delta > 0
            where = "same tokens" if first is None else f"tokens differ from position {first}"
            print(f"{name:8} prompt {i} ({len(ids[i])} tokens): {where}, max |logprob difference| {delta:.3g}")
    print("every prompt got the same bits batched as alone" if not differ else f"{differ} results differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
