"""Start-up: seconds from the command to the first generated token, and to a healthy server, each in a new process.

- `inferno generate`: `python -m inferno.entrypoints.cli generate PROMPT --model M --temperature 0`, timed from
  the process start to the first visible character it prints (the first token, streamed). It runs eagerly, so
  the inductor cache plays no part.
- `inferno serve` (the first --model only): `python -m inferno.entrypoints.cli serve --model M`, timed to the first
  `GET /health` 200 (polled every 20 ms); the seconds until the log says decode steps run compiled are reported
  too, when that happens within --compile-timeout (the engine serves eagerly until then).
- llama-cpp-python: a new process that imports `llama_cpp`, loads the same file (n_ctx 2048) and generates the
  first token of the same prompt (skipped where llama-cpp-python is not installed).
Cold: the native kernels are built (an untimed warm-up run builds them), TORCHINDUCTOR_CACHE_DIR is a new empty
folder for every run. Warm: one folder shared by every run, filled by an untimed run first (llama.cpp: its file
in the page cache, as for every row). Medians of --repeats;
each run's breakdown (import, model load, KV cache, ...) comes from the engine's log timestamps.
Results print as a table and replace the `startup` section of --output.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_md import write_section  # noqa: E402  (benchmarks/results_md.py)

PROMPT = "The capital of France is"
LLAMACPP_FIRST_TOKEN = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]),
            verbose=False)
for token in llm.generate(llm.tokenize(sys.argv[3].encode()), temp=0.0):
    print(llm.detokenize([token]).decode(errors="replace") or "?", flush=True)
    break
"""


BREAKDOWN = """
import json, sys, time
times, last = {}, time.perf_counter()


def mark(name):
    global last
    now = time.perf_counter()
    times[name], last = now - last, now


def timed(name, f):
    def run(*args, **kwargs):
        start = time.perf_counter()
        result = f(*args, **kwargs)
        times[name] = time.perf_counter() - start
        return result
    return run


import torch
mark("import torch")
from inferno import LLMEngine, SamplingParams
from inferno.config import EngineConfig
from inferno.kernels import paged_attention, quantized_gemv
import inferno.worker.worker as worker
mark("import inferno")
paged_attention(), quantized_gemv()
mark("load native kernels")
worker.load_model = timed("load model", worker.load_model)
worker.ModelRunner = timed("model runner + KV cache", worker.ModelRunner)
engine = LLMEngine(EngineConfig(model=sys.argv[1], enforce_eager=True))
mark("engine")
times["engine"] -= times["load model"] + times["model runner + KV cache"]
engine.add_request("0", sys.argv[2], SamplingParams(max_tokens=1, temperature=0))
while engine.has_unfinished_requests():
    engine.step()
mark("prompt + first token")
print(json.dumps(times))
"""


def breakdown(model: str, env: dict[str, str]) -> dict[str, float]:
    """Seconds of each start-up phase, in a new process (eager: what runs before the first token)."""
    out = subprocess.run([sys.executable, "-c", BREAKDOWN, model, PROMPT], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def inferno_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "inferno.entrypoints.cli", *args]


def environment(inductor_cache: str, num_threads: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=inductor_cache,
               OMP_NUM_THREADS=str(num_threads), PYTHONUNBUFFERED="1")
    env.pop("INFERNO_ENFORCE_EAGER", None)
    return env


def time_to_first_output(command: list[str], env: dict[str, str], timeout: float) -> float:
    """Seconds from starting `command` to the first non-blank character on its stdout; the process is then ended."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        while (char := process.stdout.read(1)) and char.isspace():
            pass
        if not char:
            raise RuntimeError(f"{shlex.join(command)} printed nothing (exit status {process.wait()})")
        elapsed = time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"{shlex.join(command)} took longer than {timeout} s")
        return elapsed
    finally:
        process.kill()
        process.wait()


def time_to_healthy(command: list[str], env: dict[str, str], port: int, timeout: float,
                    compile_timeout: float) -> tuple[float, float | None]:
    """Seconds to the first /health 200, and to the log line saying decode runs compiled (None if not seen within
    `compile_timeout` seconds after that)."""
    start = time.perf_counter()
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        healthy = None
        while healthy is None:
            if process.poll() is not None or time.perf_counter() - start > timeout:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{shlex.join(command)} never became healthy (exit status {process.poll()}):\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        healthy = time.perf_counter() - start
            except OSError:
                time.sleep(0.02)
        compiled = None
        while compiled is None and time.perf_counter() - start < healthy + compile_timeout and process.poll() is None:
            log.seek(0)
            if b"run compiled from now on" in log.read():
                compiled = time.perf_counter() - start
            time.sleep(0.2)
        return healthy, compiled
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def median_runs(run, repeats: int, fresh_cache: bool, num_threads: int) -> list:
    """`run(env)` `repeats` times, after one untimed run; each with a new empty inductor cache (cold) or all with
    the one the untimed run filled (warm)."""
    shared = tempfile.mkdtemp(prefix="inductor-warm-")
    run(environment(shared, num_threads))
    results = []
    for _ in range(repeats):
        cache = tempfile.mkdtemp(prefix="inductor-cold-") if fresh_cache else shared
        results.append(run(environment(cache, num_threads)))
    return results


def fmt(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.2f} s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=None,
                   help="GGUF file (repeatable; default: the default model). llama.cpp runs GGUF files only")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=os.cpu_count())
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-serve", action="store_true", help="skip the server rows (run for the first --model only)")
    p.add_argument("--compile-timeout", type=float, default=240.0,
                   help="seconds after /health answers to wait for the server's compiled decode step")
    p.add_argument("--output", default=str(Path(__file__).with_name("RESULTS.md")), help="'' to skip")
    args = p.parse_args()
    from inferno.loader.model_loader import default_model_path
    models = [str(Path(m).resolve()) for m in args.model or [default_model_path()]]  # the runs start in ROOT
    try:
        import llama_cpp  # noqa: F401
        have_llamacpp = True
    except ImportError:
        have_llamacpp = False
        print("llama-cpp-python is not installed: its rows are skipped", file=sys.stderr)

    rows, phases = [], []
    for model in models:
        name = Path(model).name
        phases.append((name, breakdown(model, environment(tempfile.mkdtemp(), args.num_threads))))
        print(phases[-1], flush=True)
        generate = inferno_command("generate", PROMPT, "--model", model, "--temperature", "0", "--max-tokens", "8")
        serve = inferno_command("serve", "--model", model, "--port", str(args.port), "--num-threads",
                                str(args.num_threads))
        # `generate` never compiles (it runs eagerly), so a cold inductor cache is all it ever sees
        times = median_runs(lambda env: time_to_first_output(generate, env, args.timeout), args.repeats, True,
                            args.num_threads)
        rows.append((name, "`inferno generate`, first token", statistics.median(times), None, times))
        print(rows[-1], flush=True)
        for temperature, fresh in (("cold", True), ("warm", False)):
            if args.no_serve or model != models[0]:
                break
            runs = median_runs(lambda env: time_to_healthy(serve, env, args.port, args.timeout, args.compile_timeout),
                               args.repeats, fresh, args.num_threads)
            compiled = [c for _, c in runs if c is not None]
            rows.append((name, f"`inferno serve` healthy, {temperature}", statistics.median(h for h, _ in runs),
                         statistics.median(compiled) if len(compiled) == len(runs) else None, [h for h, _ in runs]))
            print(rows[-1], flush=True)
        if have_llamacpp:
            command = [sys.executable, "-c", LLAMACPP_FIRST_TOKEN, model, str(args.num_threads), PROMPT]
            times = median_runs(lambda env: time_to_first_output(command, env, args.timeout), args.repeats, False,
                                args.num_threads)
            rows.append((name, "llama-cpp-python, first token", statistics.median(times), None, times))
            print(rows[-1], flush=True)

    command = shlex.join(["python", "startup.py", *sys.argv[1:]])
    lines = ["## Start-up (`benchmarks/startup.py`)", "",
             f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- Machine: {os.cpu_count()} CPU cores ({cpu_name()}), {args.num_threads} threads; load average "
             f"{os.getloadavg()[0]:.1f} at the end (a shared machine: compare rows within one run)",
             f"- Command (from benchmarks/): `{command}`",
             f"- New process per run, median of {args.repeats} (each run listed); cold: empty TORCHINDUCTOR_CACHE_DIR, "
             "native kernels already built; prompt {PROMPT!r}, greedy".replace("{PROMPT!r}", repr(PROMPT)),
             "", "| model | what | median | compiled decode from | runs |", "|---|---|---:|---:|---|"]
    for name, what, median, compiled, times in rows:
        lines.append(f"| {name} | {what} | {fmt(median)} | {fmt(compiled)} | "
                     f"{', '.join(f'{t:.2f}' for t in times)} |")
    for name, times in phases:
        lines += ["", f"Where the eager start-up of {name} goes (one run, in-process marks, `breakdown()` in "
                  f"startup.py): " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()) + " (engine: the rest of "
                  "its construction)"]
    print("\n".join(lines))
    if args.output:
        write_section(Path(args.output), "startup", "\n".join(lines))


def cpu_name() -> str:
    if Path("/proc/cpuinfo").exists():
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                flags = {"avx512f", "avx2", "avx_vnni"} & set(open("/proc/cpuinfo").read().split())
                return f"{line.split(':', 1)[1].strip()}; {', '.join(sorted(flags))}"
    return "unknown CPU"


if __name__ == "__main__":
    main()
