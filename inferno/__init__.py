"""inferno: LLM inference and serving on PyTorch.

The public names load on first use, so `import inferno.kernels` (or any lower layer) does not import the engine."""
import importlib

from inferno.core.startup_gc import gc_paused

_EXPORTS = {
    "LLM": "inferno.entrypoints.llm",
    "LLMEngine": "inferno.engine.llm_engine",
    "SamplingParams": "inferno.sampling_params",
    "RequestOutputKind": "inferno.sampling_params",
    "StructuredOutputsParams": "inferno.sampling_params",
    "RequestOutput": "inferno.outputs",
    "CompletionOutput": "inferno.outputs",
    "Logprob": "inferno.outputs",
    "PoolingRequestOutput": "inferno.outputs",
    "EmbeddingRequestOutput": "inferno.outputs",
    "EmbeddingOutput": "inferno.outputs",
    "PoolingParams": "inferno.pooling_params",
    "LoRARequest": "inferno.lora_request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'inferno' has no attribute {name!r}")
    with gc_paused(freeze=True):  # importing torch and inferno builds objects as long-lived as the process (startup_gc)
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
