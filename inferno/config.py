"""Configuration: the model's shape (read from its files) and the engine's knobs (chosen by the user)."""
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATION_METHODS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
KV_CACHE_DTYPE_NAMES = ("auto", "int8", "fp8_e4m3")


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF file or HF folder; None: the default model
    dtype: str = "auto"  # "auto": bfloat16 with quantized weights (their kernels want it), else float32
    quantization: str | None = None  # weight-only: None, "int8" (per output channel) or "int4" (group-wise)
    quantization_group_size: int = 32  # int4 only: input columns per scale/zero (32 loads GGUF Q4_0/Q4_1 as is)
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int = 4 << 30  # bytes for the KV cache pool (vLLM's CPU default is 4 GiB)
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "int8" / "fp8_e4m3": codes + per-token-per-head scales
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # per rank; default with more than one rank: the cores divided among the ranks
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_timeout: float = 60.0  # seconds a rank waits in a collective inside a step before failing

    def __post_init__(self) -> None:
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)} or None, "
                             f"got {self.quantization!r}")
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {list(INT4_GROUP_SIZES)}, "
                             f"got {self.quantization_group_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPE_NAMES)}, got {self.kv_cache_dtype!r}")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.quantization else "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_memory",
                     "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.quantization is not None and self.tensor_parallel_size > 1:
            # the quantized layers hold whole weights and do no all-reduce: they replace the tensor-parallel ones
            raise ValueError("quantization is not supported with tensor_parallel_size > 1 "
                             "(pipeline_parallel_size > 1 is: each stage quantizes its own layers)")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be positive, got {self.distributed_timeout}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
