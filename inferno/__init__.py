"""inferno: LLM inference and serving on PyTorch."""
import gc

from inferno.core.startup_gc import gc_paused

with gc_paused():  # importing torch and inferno builds objects that live as long as the process: core/startup_gc.py
    from inferno.engine.llm_engine import LLMEngine
    from inferno.entrypoints.llm import LLM
    from inferno.outputs import CompletionOutput, Logprob, RequestOutput
    from inferno.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
    gc.freeze()

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "StructuredOutputsParams"]
