"""The manual stays true to the code: the configuration reference matches `EngineConfig`, every Python example
compiles and imports what exists and passes only keyword arguments its callee takes, links resolve, and
benchmarks/RESULTS.md keeps one section per title. No model is loaded."""
import ast
import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from inferno import LLM, SamplingParams, StructuredOutputsParams
from inferno.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# README links to pages written on other branches at the same time; the lead empties this set when they land
def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(first line number, source) of each ```python block."""
    blocks, lines = [], page.read_text().split("\n")
    for i, line in enumerate(lines):
        if line.strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append((i + 2, "\n".join(lines[i + 1:end])))
    return blocks


EXAMPLES = [pytest.param(page, line, source, id=f"{page.name}:{line}")
            for page in PAGES for line, source in python_blocks(page)]


def reference_rows() -> dict[str, str]:
    """The configuration reference's table: field name -> its default cell."""
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", (ROOT / "docs" / "configuration.md").read_text(), re.M)
    return {name: default.strip() for name, default in rows}


def documented_default(value) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def test_configuration_reference_lists_every_engine_config_field_and_no_other():
    documented, actual = set(reference_rows()), {f.name for f in fields(EngineConfig)}
    assert not actual - documented, f"EngineConfig fields missing from docs/configuration.md: {actual - documented}"
    assert not documented - actual, f"docs/configuration.md documents fields EngineConfig lacks: {documented - actual}"


def test_configuration_reference_defaults_match_engine_config(monkeypatch):
    rows = reference_rows()
    for f in fields(EngineConfig):
        if f.default is not MISSING:
            assert rows[f.name].startswith(documented_default(f.default)), (f.name, rows[f.name], f.default)
    # the one default_factory reads the environment (the test suite sets INFERNO_ENFORCE_EAGER=1)
    factory = next(f.default_factory for f in fields(EngineConfig) if f.name == "enforce_eager")
    monkeypatch.delenv("INFERNO_ENFORCE_EAGER", raising=False)
    assert rows["enforce_eager"].startswith(documented_default(factory()))
    monkeypatch.setenv("INFERNO_ENFORCE_EAGER", "1")
    assert f"`INFERNO_ENFORCE_EAGER=1`: {documented_default(factory())}" in rows["enforce_eager"]
    assert [f.name for f in fields(EngineConfig) if f.default is MISSING] == ["enforce_eager"]


@pytest.mark.parametrize("page, line, source", EXAMPLES)
def test_python_example_compiles_and_its_imports_resolve(page, line, source):
    tree = ast.parse(source, filename=f"{page.name}:{line}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.module.split(".")[0] == "inferno":
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{page.name}:{line}: {node.module} has no {missing}"
            else:
                assert importlib.util.find_spec(node.module) is not None, f"{page.name}:{line}: no {node.module}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert importlib.util.find_spec(alias.name) is not None, f"{page.name}:{line}: no {alias.name}"


def accepted_keywords(callee) -> set[str]:
    if callee is LLM:
        return {f.name for f in fields(EngineConfig)}
    return set(inspect.signature(callee).parameters)


@pytest.mark.parametrize("page, line, source", EXAMPLES)
def test_python_example_passes_only_known_keyword_arguments(page, line, source):
    callees = {"LLM": LLM, "SamplingParams": SamplingParams, "StructuredOutputsParams": StructuredOutputsParams}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in callees:
            unknown = {k.arg for k in node.keywords} - accepted_keywords(callees[node.func.id]) - {None}
            assert not unknown, f"{page.name}:{line}: {node.func.id} takes no {unknown}"


def github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: broken link {target}"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved), f"{page.name}: no heading for #{anchor} in {resolved.name}"


def test_results_md_has_one_section_per_title_and_paired_markers():
    text = RESULTS.read_text()
    titles = re.findall(r"^## (.+)$", text, re.M)
    assert len(titles) == len(set(titles)), sorted(t for t in titles if titles.count(t) > 1)
    for name in re.findall(r"<!-- (\S+):start -->", text):
        assert text.count(f"<!-- {name}:start -->") == 1 and text.count(f"<!-- {name}:end -->") == 1, name


def results_md():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import results_md
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return results_md


def test_results_md_section_is_replaced_in_place_with_date_and_machine(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text(RESULTS.read_text())
    results_md().write_section(results, "serve", "## Online serving (`benchmarks/serve.py`)\n\nnew table")
    before, after = RESULTS.read_text(), results.read_text()
    section = after.split("<!-- serve:start -->")[1].split("<!-- serve:end -->")[0]
    assert after.count("## Online serving") == 1 and after.count("<!-- serve:start -->") == 1
    assert re.fullmatch(r"\n## Online serving .*\n\n- Date: .* UTC\n- Machine: .*\n\nnew table\n", section), section
    assert after.split("<!-- serve:start -->")[0] == before.split("<!-- serve:start -->")[0]
    assert after.split("<!-- serve:end -->")[1] == before.split("<!-- serve:end -->")[1]


def test_results_md_keeps_a_section_s_own_date(tmp_path):
    results = tmp_path / "RESULTS.md"
    body = "## A benchmark\n\n- Date: 2026-01-01 00:00 UTC\n- Machine: described by the script\n\n| a |"
    results_md().write_section(results, "a", body)
    results_md().write_section(results, "b", "## B\n\n| b |")
    text = results.read_text()
    assert f"<!-- a:start -->\n{body}\n<!-- a:end -->" in text and text.count("- Date:") == 2
