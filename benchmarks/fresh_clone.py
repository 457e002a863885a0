"""A new user's first command: `make demo` in a fresh clone, timed from `git clone` to the answer on screen.

It clones this repository's HEAD into a temporary folder (only what is committed: no build output, no venv), runs
`make demo` there under `/usr/bin/time`, and reports the wall time, the CPU time over the cores and what each step
took (the Makefile's lines are timestamped as they appear). pip's cache is whatever the machine has: say which in
`--pip-cache` ("warm": the packages were downloaded before on this machine; "cold": a first install).

    python benchmarks/fresh_clone.py --pip-cache warm
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import write_section

REPO = Path(__file__).resolve().parent.parent


def timed_lines(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[list[tuple[float, str]], str, int]:
    """Run `command`, each output line with the seconds since the start; the `time -v` report; the exit status."""
    start = time.monotonic()
    report = cwd / "time.txt"
    proc = subprocess.Popen(["/usr/bin/time", "-v", "-o", str(report), *command], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    for line in proc.stdout:
        if line.startswith("WARNING: Location"):  # pip's note about each missing file:// index of this machine
            continue
        lines.append((time.monotonic() - start, line.rstrip()))
        print(f"{lines[-1][0]:7.1f} s  {lines[-1][1]}", flush=True)
    return lines, report.read_text() if report.exists() else "", proc.wait()


def time_report_value(report: str, key: str) -> float:
    match = re.search(rf"{re.escape(key)}: ([\d.:]+)", report)
    if not match:
        return float("nan")
    parts = [float(p) for p in match.group(1).split(":")]
    return sum(p * 60 ** i for i, p in enumerate(reversed(parts)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pip-cache", choices=["warm", "cold"], required=True, help="the state of pip's cache, as known")
    p.add_argument("--results", type=Path, default=Path(__file__).parent / "RESULTS.md")
    args = p.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, capture_output=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="inferno-clone-") as tmp:
        clone = Path(tmp) / "inferno"
        start = time.monotonic()
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        cloned = time.monotonic() - start
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        lines, report, status = timed_lines(["make", "demo"], clone, env)
        wall = cloned + time_report_value(report, "Elapsed (wall clock) time (h:mm:ss or m:ss)")
        cpu = time_report_value(report, "User time (seconds)") + time_report_value(report, "System time (seconds)")
    if status != 0:
        sys.exit(f"make demo failed with exit status {status}")
    steps = [(t, line) for t, line in lines if line.startswith((".venv/", "python3 ", "building", "touch"))]
    rows = "\n".join(f"| {t + cloned:.1f} s | `{line[:110]}` |" for t, line in steps)
    answer = lines[-1][1] if lines else ""
    body = f"""## A fresh clone's `make demo` (`benchmarks/fresh_clone.py`)

- Command: `python benchmarks/fresh_clone.py --pip-cache {args.pip_cache}` (a `git clone` of {head}, then `make demo`
  in it; pip's cache {args.pip_cache})
- **{wall:.0f} s** from `git clone` to the answer (goal: 2 min), {cpu:.0f} s of CPU over the cores
- The answer: "{answer}"

| from the clone | step |
|---:|---|
{rows}
| {wall:.1f} s | the answer |
"""
    print(body)
    write_section(args.results, "fresh-clone-make-demo", body)


if __name__ == "__main__":
    main()
