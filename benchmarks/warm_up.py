"""The warm-up timeline of a first and a second start of the same model: seconds from the command to the compiled
decode step (and the CPU time spent until then), decode speed over time, and the slowest step while the engine warms
up.

Each start is a new process (`python warm_up.py --child ...`) that builds an `LLMEngine` with the defaults and
decodes one greedy request of --max-tokens after another (--gap seconds apart), timing every engine step from the
command (the parent's clock before it starts the process). The first start gets an empty compile cache (INFERNO_COMPILE_CACHE, a new
folder), the second start the folder the first one filled. A step slower than --stall seconds gets every thread's
Python stack dumped to the child's stderr while it is still running (faulthandler, which needs no GIL), so a stall
shows what the warm-up thread was doing. Results print as a table and replace the `warm_up` section of --output
(`warm_up-<model>` for a model other than the default).
"""
import argparse
import faulthandler
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_md import write_section  # noqa: E402  (benchmarks/results_md.py)
from startup import cpu_name  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."


def child(args: argparse.Namespace) -> None:
    """One start: steps timed from `args.launched` (time.time() when the parent started this process)."""
    import logging
    from inferno import LLMEngine, SamplingParams
    from inferno.config import EngineConfig
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)9.0f ms %(message)s")
    engine = LLMEngine(EngineConfig(model=args.model))
    runner = engine.model_runner
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    steps, compiled_at, cpu_at_compiled, request = [], None, None, 0
    while time.time() - args.launched < args.duration:
        engine.add_request(str(request), PROMPT, params)
        request += 1
        while engine.has_unfinished_requests():
            faulthandler.dump_traceback_later(args.stall)
            start = time.time()
            outputs = engine.step()
            end = time.time()
            faulthandler.cancel_dump_traceback_later()
            tokens = len(outputs)  # one token per running request
            steps.append((start - args.launched, end - start, tokens, runner.compiled_decode is not None))
            if compiled_at is None and runner.compiled_decode is not None:
                compiled_at = end - args.launched
                cpu_at_compiled = cpu_seconds()
        if compiled_at is not None and time.time() - args.launched > compiled_at + args.after:
            break
        time.sleep(args.gap)
    print(json.dumps({"steps": steps, "compiled_at": compiled_at, "cpu_at_compiled": cpu_at_compiled}))


def cpu_seconds() -> float:
    """CPU seconds this process and the processes it has waited for (the compilers inductor ran) have used."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def run_start(args: argparse.Namespace, cache: str) -> dict:
    """One start in a new process with `cache` as its compile cache; its steps and when decode ran compiled."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), INFERNO_COMPILE_CACHE=cache, PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=str(args.num_threads))
    for name in ("TORCHINDUCTOR_CACHE_DIR", "INFERNO_ENFORCE_EAGER"):
        env.pop(name, None)
    command = [sys.executable, __file__, "--child", "--model", args.model, "--launched", "0",
               "--duration", str(args.duration), "--after", str(args.after), "--max-tokens", str(args.max_tokens),
               "--stall", str(args.stall), "--gap", str(args.gap)]
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        command[command.index("--launched") + 1] = repr(time.time())
        out = subprocess.run(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        if out.returncode:
            log.seek(0)
            raise RuntimeError(f"{shlex.join(command)} failed ({out.returncode}):\n{log.read()[-3000:]}")
    print(f"log of this start: {log.name}", file=sys.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(name: str, result: dict, window: float) -> list:
    """A table row: compiled-from, the slowest step before it (and overall), decode tok/s per `window` seconds."""
    steps, compiled_at = result["steps"], result["compiled_at"]
    warm = [s for s in steps if compiled_at is None or s[0] < compiled_at]
    slowest_warm = max((s[1] for s in warm), default=0.0)
    slowest = max(s[1] for s in steps)
    buckets: dict[int, list] = {}
    for start, duration, tokens, _ in steps:
        buckets.setdefault(int(start // window), []).append((duration, tokens))
    speeds = [f"{int(b * window)}-{int((b + 1) * window)} s: "
              f"{sum(t for _, t in v) / max(sum(d for d, _ in v), 1e-9):.0f}" for b, v in sorted(buckets.items())]
    decode = [d for _, d, t, c in steps if t and c]
    steady = 1 / statistics.median(decode) if decode else None
    return [name, compiled_at, result["cpu_at_compiled"], slowest_warm, slowest, steady, steps[0][0] + steps[0][1],
            "; ".join(speeds)]


def fmt(value: float | None, unit: str = " s") -> str:
    return "–" if value is None else f"{value:.2f}{unit}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the default model)")
    p.add_argument("--num-threads", type=int, default=os.cpu_count())
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--duration", type=float, default=400.0, help="seconds a start may run at most")
    p.add_argument("--after", type=float, default=20.0, help="seconds to go on decoding once compiled")
    p.add_argument("--window", type=float, default=10.0, help="seconds per decode-speed bucket")
    p.add_argument("--gap", type=float, default=0.0, help="seconds between one request's end and the next one "
                   "(0: back to back, the serving thread always busy; the issue's user sent one every 2-3 s)")
    p.add_argument("--stall", type=float, default=1.0, help="a step longer than this dumps every thread's stack")
    p.add_argument("--cache", default=None, help="compile cache folder for the first start (default: a new one)")
    p.add_argument("--output", default=str(Path(__file__).with_name("RESULTS.md")), help="'' to skip")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--launched", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    from inferno.loader.model_loader import default_model_path
    default = args.model is None
    args.model = str(Path(args.model or default_model_path()).resolve())
    cache = args.cache or tempfile.mkdtemp(prefix="inferno-compile-")
    rows = []
    for name in ("first start (empty cache)", "second start (same cache)"):
        rows.append(summary(name, run_start(args, cache), args.window))
        print(rows[-1], flush=True)

    command = shlex.join(["python", "warm_up.py", *sys.argv[1:]])
    section = "warm_up" if default else f"warm_up-{Path(args.model).stem}"
    lines = [f"## Warm-up{'' if default else ' of ' + Path(args.model).name} (`benchmarks/warm_up.py`)", "",
             f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- Machine: {os.cpu_count()} CPU cores ({cpu_name()}), {args.num_threads} threads; load average "
             f"{os.getloadavg()[0]:.1f} at the end",
             f"- Command (from benchmarks/): `{command}`; model {Path(args.model).name}",
             f"- One greedy {args.max_tokens}-token request after another ({args.gap:g} s apart) from the command on, "
             "every step timed; times from the command",
             "", "| start | compiled decode from | CPU time until then | slowest step before it | slowest step | "
             "steady decode | first token | decode tok/s over time |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, compiled, cpu, slowest_warm, slowest, steady, first, speeds in rows:
        lines.append(f"| {name} | {fmt(compiled)} | {fmt(cpu)} | {fmt(slowest_warm)} | {fmt(slowest)} | "
                     f"{fmt(steady, ' tok/s')} | {fmt(first)} | {speeds} |")
    print("\n".join(lines))
    if args.output:
        write_section(Path(args.output), section, "\n".join(lines))


if __name__ == "__main__":
    main()
