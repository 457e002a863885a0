"""The layers contract in pyproject.toml (import-linter) holds, and it catches an upward import."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def lint_imports(project: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the `inferno` package found in `project` (put first on the path: not an installed one)."""
    env = {**os.environ, "PYTHONPATH": str(project)}
    return subprocess.run([sys.executable, "-c", LINT], cwd=project, env=env, capture_output=True, text=True)


def test_imports_only_go_downward():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "inferno", tmp_path / "inferno", ignore=shutil.ignore_patterns("__pycache__", "*.cpp"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    input_batch = tmp_path / "inferno" / "worker" / "input_batch.py"
    input_batch.write_text(input_batch.read_text() + "\nfrom inferno.engine.scheduler import Scheduler\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "inferno.worker.input_batch -> inferno.engine.scheduler" in result.stdout


def modules_loaded_by(statement: str) -> set[str]:
    """The inferno modules a fresh interpreter has loaded after `statement`."""
    code = f"import sys; {statement}; print(' '.join(m for m in sys.modules if m.startswith('inferno')))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_a_lower_layer_imports_without_the_engine():
    assert "inferno.engine.llm_engine" not in modules_loaded_by("import inferno.kernels")
    assert modules_loaded_by("import inferno") == {"inferno", "inferno.core", "inferno.core.startup_gc"}


def test_the_public_names_load_on_first_use():
    loaded = modules_loaded_by("from inferno import LLM, SamplingParams")
    assert {"inferno.entrypoints.llm", "inferno.engine.llm_engine", "inferno.sampling_params"} <= loaded
