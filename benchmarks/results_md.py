"""benchmarks/RESULTS.md is shared by several benchmarks: each owns one marked section and rewrites only that, so
the file holds one current table per benchmark (earlier runs stay in git history)."""
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

from inferno.cpu_features import cpu_flags, cpu_info

SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8")


def run_stamp() -> str:
    """The date and machine lines every section carries: what a reader needs to tell two runs apart."""
    flags = ", ".join(f for f in SIMD_FLAGS if f in cpu_flags()) or "no AVX2"
    cpu = cpu_info().get("model name", platform.processor() or platform.machine())
    return (f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n"
            f"- Machine: {cpu} ({flags}), {os.cpu_count()} CPUs")


def write_section(path: Path, name: str, body: str) -> None:
    """Put `body` between the `<!-- name:start -->` / `<!-- name:end -->` markers of `path`, leaving every
    other section as it was (the section is appended the first time). A body without a `- Date:` line gets
    run_stamp() under its title."""
    if "\n- Date:" not in body:
        title, _, rest = body.partition("\n")
        rest = rest.lstrip("\n")
        body = f"{title}\n\n{run_stamp()}\n\n{rest}"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1].removeprefix("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def publish(output: str, name: str, body: str) -> None:
    """Print a benchmark's section and, unless `output` is '', write it into that file (`write_section`)."""
    print("\n" + body)
    if output:
        write_section(Path(output), name, body)
        print(f"updated {output}")
