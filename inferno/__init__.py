"""inferno: LLM inference and serving on PyTorch."""
from inferno.core.startup_gc import gc_paused

with gc_paused(freeze=True):  # importing torch and inferno builds objects as long-lived as the process (startup_gc)
    from inferno.engine.llm_engine import LLMEngine
    from inferno.entrypoints.llm import LLM
    from inferno.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                                 PoolingRequestOutput, RequestOutput)
    from inferno.pooling_params import PoolingParams
    from inferno.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "StructuredOutputsParams", "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput",
           "EmbeddingOutput"]
