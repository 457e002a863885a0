"""benchmarks/RESULTS.md is shared by several benchmarks: each owns one marked section and rewrites only that."""
from pathlib import Path


def write_section(path: Path, name: str, body: str) -> None:
    """Put `body` between the `<!-- name:start -->` / `<!-- name:end -->` markers of `path`, leaving every
    other section as it was (the section is appended the first time)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1].removeprefix("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
