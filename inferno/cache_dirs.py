"""The folders inferno keeps between runs, under the user's cache directory (XDG_CACHE_HOME, else ~/.cache)."""
import os
from pathlib import Path

from inferno.cpu_features import cpu_key


def user_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inferno"


def compile_cache_dir() -> Path:
    """Where the compiled decode step is kept (worker/compile_cache.py): INFERNO_COMPILE_CACHE, else inferno/compile
    in the user's cache directory; one folder per CPU in it (inductor builds for the CPU at hand)."""
    if os.environ.get("INFERNO_COMPILE_CACHE"):
        return Path(os.environ["INFERNO_COMPILE_CACHE"]) / cpu_key()
    return user_cache_dir() / "compile" / cpu_key()
