"""The eager decode step against the compiled one, in one process: median `engine.step()` time of greedy decode
steps at batch 1 and batch 16, eager (`enforce_eager=True`) then compiled (after the warm-up), plus a prompt's
prefill step; with --profile, where the eager step's CPU time goes (torch.profiler, top operators) and how much of the
step is the model runner's `execute_model` (the rest: scheduler, stop checks, outputs).

    python benchmarks/eager_step.py [--model FILE] [--dtype D] [--batches 1 16] [--steps 60] [--temperature T]
                                    [--profile] [--no-compiled]
"""
import argparse
import itertools
import statistics
import time

from inferno import LLMEngine, SamplingParams
from inferno.config import EngineConfig

PROMPT = "Write a short story about a lighthouse keeper."
CLOCK = time.perf_counter
TEMPERATURE = 0.0  # --temperature: greedy by default
PREFILL_TOKENS = itertools.count(100)  # a token of its own per prompt: no prefix-cache hit on a later call


def decode_steps(engine: LLMEngine, batch: int, steps: int) -> list[float]:
    """Seconds of each engine step once `batch` requests (greedy unless --temperature) all decode (their prompts'
    steps left out): wall time, or with --cpu-time the process's CPU time (steadier on a loaded machine, with
    --threads 1)."""
    params = SamplingParams(max_tokens=steps + 8, temperature=TEMPERATURE, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{time.time()}-{i}", PROMPT, params)
    times = []
    while engine.has_unfinished_requests():
        start = CLOCK()
        engine.step()
        times.append(CLOCK() - start)
    return times[4:-4]


def prefill_step(engine: LLMEngine, prompt_tokens: int, samples: int = 3) -> float:
    """Seconds of the step that runs a prompt of `prompt_tokens` tokens whole (median of `samples`)."""
    times = []
    for i in range(samples):
        token = next(PREFILL_TOKENS)
        engine.add_request(f"prefill-{time.time()}-{i}", {"prompt_token_ids": [token] * prompt_tokens},
                           SamplingParams(max_tokens=1))
        start = CLOCK()
        engine.step()
        times.append(CLOCK() - start)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)


def measure(engine: LLMEngine, args: argparse.Namespace) -> dict[str, float]:
    decode_steps(engine, 1, 16)  # first steps: tiles made, allocator warm
    engine.wait_for_warm_up()  # eager too: the weights tiled and on huge pages
    results = {f"decode b={b}": statistics.median(decode_steps(engine, b, args.steps)) for b in args.batches}
    results[f"prefill {args.prompt_tokens}"] = prefill_step(engine, args.prompt_tokens)
    return results


def execute_share(engine: LLMEngine, steps: int) -> float:
    """Fraction of the batch-1 step spent in the model runner's execute_model."""
    runner, spent = engine.model_runner, []
    execute = runner.execute_model

    def timed(sched):
        start = CLOCK()
        try:
            return execute(sched)
        finally:
            spent.append(CLOCK() - start)
    runner.execute_model = timed
    try:
        total = sum(decode_steps(engine, 1, steps))
    finally:
        del runner.execute_model
    return sum(spent[4:-4]) / total


def profile(engine: LLMEngine, steps: int, table: bool) -> None:
    """The operators a batch-1 step calls (torch.profiler), their count and, with `table`, the top ones."""
    from torch.profiler import profile as torch_profile
    engine.add_request("profiled", PROMPT, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    for _ in range(5):
        engine.step()
    with torch_profile() as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.key_averages()
    if table:
        print(events.table(sort_by="self_cpu_time_total", row_limit=20))
    print(f"operator calls per step: {sum(e.count for e in events) / steps:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the default model)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-compiled", action="store_true", help="the eager engine only")
    parser.add_argument("--dtype", default="auto", help="the float dtype of an HF folder (float32, bfloat16)")
    parser.add_argument("--threads", type=int, default=None, help="the engine's threads (default: all cores)")
    parser.add_argument("--cpu-time", action="store_true", help="time steps by the process's CPU time")
    parser.add_argument("--temperature", type=float, default=0.0, help="decode steps sample at this temperature")
    args = parser.parse_args()
    global CLOCK, TEMPERATURE
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    TEMPERATURE = args.temperature
    rows, options = {}, {"model": args.model, "num_threads": args.threads, "dtype": args.dtype}
    eager = LLMEngine(EngineConfig(**options, enforce_eager=True))
    rows["eager"] = measure(eager, args)
    print(f"eager: execute_model is {execute_share(eager, args.steps):.0%} of a batch-1 step", flush=True)
    profile(eager, 20, args.profile)
    eager.shutdown()
    del eager
    if not args.no_compiled:
        compiled = LLMEngine(EngineConfig(**options))
        decode_steps(compiled, 1, 8)  # the warm-up starts after the first step
        if not compiled.wait_for_warm_up():
            raise SystemExit("the decode step did not compile")
        rows["compiled"] = measure(compiled, args)
        compiled.shutdown()
    print(f"{'':10}" + "".join(f"{name:>16}" for name in rows["eager"]))
    for engine, results in rows.items():
        print(f"{engine:10}" + "".join(f"{seconds * 1e3:13.2f} ms" for seconds in results.values()))
    if "compiled" in rows:
        print(f"{'ratio':10}" + "".join(f"{rows['eager'][k] / rows['compiled'][k]:15.2f}x" for k in rows["eager"]))


if __name__ == "__main__":
    main()
