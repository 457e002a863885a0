"""Configuration: the model's shape (read from its files) and the engine's knobs (chosen by the user)."""
import json
import os
from dataclasses import dataclass, field

import torch

from inferno.core.kv_transfer import KV_ROLES, KV_TRANSFER_BACKENDS, KV_TRANSFER_FALLBACKS
from inferno.cpu_features import has_native_bfloat16
from inferno.speculative_config import HEAD_METHODS, SpeculativeConfig, is_positive_int


@dataclass(slots=True)
class RopeScaling:
    """Rope frequency scaling: "llama3" (frequency-dependent), "linear" (positions divided by `factor`) or
    "longrope" (Phi-3's per-frequency divisors, short ones within the original context and long ones beyond it,
    cos/sin scaled by `attention_factor`)."""
    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position_embeddings: int = 0
    short_factor: list[float] | None = None
    long_factor: list[float] | None = None
    attention_factor: float = 1.0


@dataclass(slots=True)
class MoEConfig:
    """Mixture-of-experts feed-forward: each token runs `top_k` of `num_experts` routed MLPs, weighted by the
    router's softmax (renormalised over the chosen ones with `norm_topk_prob`), plus an optional shared expert
    (qwen2_moe: its output scaled by sigmoid(shared_expert_gate))."""
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP instead (qwen MoE mlp_only_layers)


POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's names


@dataclass(slots=True)
class PoolerConfig:
    """How the model turns a prompt's final hidden states (after the final norm) into one embedding: the last
    token's, the mean of all, or the first (CLS) token's; L2-normalized or not. `matryoshka_dimensions`: the
    lengths the model was trained to be truncated to (an empty list: any length; None: not trained for it)."""
    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka_dimensions: list[int] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got {self.pooling_type!r}")


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3" | "phi3" | MoE: docs/models.md
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
    # RMSNorm of q and k before rotary: "head" over each head (qwen3, gemma3), "full" over all heads (olmoe)
    qk_norm: str | None = None
    sliding_window: int | None = None  # keys within this many positions of the query (HF: q - k < window)
    # per layer, whether its attention is limited to `sliding_window`; None: every layer (when there is a window)
    sliding_layers: list[bool] | None = None
    # Gemma: norms scale by (1 + w), extra norms after attention and feed-forward, GeGLU, embeddings x sqrt(hidden),
    # tanh soft-capping of attention scores and final logits, scores scaled by query_pre_attn_scalar ** -0.5
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # "silu" | "gelu_pytorch_tanh"
    embedding_multiplier: float = 1.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' rope base (no scaling there)
    moe: MoEConfig | None = None
    pooler: PoolerConfig = field(default_factory=PoolerConfig)  # embeddings (loader/pooler_config.py)

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.sliding_layers is None or self.sliding_layers[layer]

    @property
    def kv_window(self) -> int | None:
        """The window of every layer when all are sliding (older KV blocks can be freed), else None."""
        return self.sliding_window if self.sliding_layers is None or all(self.sliding_layers) else None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATION_METHODS = ("auto", "int8", "int4", "w8a8")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
PER_CHANNEL = -1  # quantization_group_size for int8 with one scale per output channel (GPTQ's "-1")
KV_CACHE_DTYPE_NAMES = ("auto", "float16", "bfloat16", "float32", "int8", "fp8_e4m3")
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8_e4m3")
DEVICES = ("auto", "cpu", "cuda")
# "auto": Triton on CUDA; on the CPU the native decode kernel where it can run the model, else PyTorch
ATTENTION_BACKENDS = ("auto", "torch", "cpu_kernel", "triton")
# "generate": text generation, embeddings on request too; "pooling": an embedding model, which only pools
RUNNERS = ("generate", "pooling")


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF file or HF folder; None: the default model
    device: str = "auto"  # "auto": CUDA when torch sees a GPU, else the CPU
    # "auto": on the CPU bfloat16 where it has native bfloat16 GEMMs (AVX512-BF16, AMX) and the weights are float,
    # else float32 (see weights_run_in_integer_kernels); on CUDA bfloat16 (float16 before Ampere)
    dtype: str = "auto"
    # weight-only: "auto" runs a GGUF file's quantized blocks (or an AWQ / GPTQ folder's codes) as stored (float
    # checkpoints stay float); None dequantizes them to float; "int8" or "int4" (both group-wise) quantize every
    # projection; "w8a8": int8 weights and per-token int8 activations, calibrated SmoothQuant factors (`calibration`)
    quantization: str | None = "auto"
    # input columns per scale and min/zero (32 loads GGUF Q4_0/Q4_1 as is); int8 also PER_CHANNEL (-1)
    quantization_group_size: int = 32
    # w8a8: the activation calibration file (`inferno calibrate`); None: the one beside the model
    calibration: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    # bytes for the KV cache pool; None: half the memory available once the weights are loaded, at most max_num_seqs
    # sequences of max_model_len tokens (inferno/worker/kv_cache.py)
    kv_cache_memory: int | None = None
    # "auto": the model dtype when it is 16-bit; float16 where the model computes in float32 on the CPU (as llama.cpp
    # stores its cache: half the memory and the bandwidth of a decode step's attention); a float dtype by name; or
    # "int8" / "fp8_e4m3": codes + per-token-per-head scales
    kv_cache_dtype: str = "auto"
    # CUDA: the fraction of the GPU's memory the engine may use (weights, activations, KV cache), as in vLLM
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    # None: 2048, or 8192 for runner "pooling", whose steps are all prompts (no decode waits behind a long step):
    # fewer, larger steps open fewer parallel regions per text
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    # None: on for runner "generate", off for "pooling": an embedding prompt's K/V is then never written (its own
    # attention reads it as computed), which pays more than the rare hit of texts sharing a 16-token prefix
    enable_prefix_caching: bool | None = None
    # decode-only steps run a torch.compile'd forward (fused elementwise ops, one call per step instead of one per
    # op); True keeps every step in eager PyTorch. Default: the INFERNO_ENFORCE_EAGER environment variable ("1").
    enforce_eager: bool = field(default_factory=lambda: os.environ.get("INFERNO_ENFORCE_EAGER") == "1")
    num_threads: int | None = None  # per rank; default with more than one rank: the cores divided among the ranks
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_timeout: float = 60.0  # seconds a rank waits in a collective inside a step before failing
    speculative_config: dict | SpeculativeConfig | None = None  # a dict as in vLLM; parsed on creation
    # disaggregated prefill and decode (core/kv_transfer.py): "prefill" computes prompts and holds their KV for
    # decode instances, which pull it from (kv_host, kv_port); None: a colocated instance
    kv_role: str | None = None
    kv_host: str = "127.0.0.1"  # prefill: the address decode instances reach its KV at
    kv_port: int = 14579
    kv_transfer_backend: str = "gloo"
    kv_transfer_timeout: float = 30.0  # seconds a transfer may take; a prefill holds unpulled blocks this long
    kv_transfer_fallback: str = "recompute"  # decode, when a pull fails: compute the prompt, or "error"
    runner: str = "generate"  # one of RUNNERS, as vLLM's --runner
    # LoRA adapters (docs/lora.md): up to max_loras distinct adapters per step, each of rank <= max_lora_rank;
    # max_cpu_loras kept in memory (default max_loras), the least recently used read again from disk when needed
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)} or None, "
                             f"got {self.quantization!r}")
        if self.quantization_group_size not in (*QUANTIZATION_GROUP_SIZES, PER_CHANNEL) or (
                self.quantization == "int4" and self.quantization_group_size == PER_CHANNEL):
            raise ValueError(f"quantization_group_size must be one of {list(QUANTIZATION_GROUP_SIZES)} (or "
                             f"{PER_CHANNEL}: per output channel, int8 only), got {self.quantization_group_size}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {list(RUNNERS)}, got {self.runner!r}")
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = self.runner != "pooling"
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if self.runner == "pooling" else 2048
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for, but torch sees no CUDA GPU (torch "
                             f"{torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPE_NAMES)}, got {self.kv_cache_dtype!r}")
        if self.dtype == "auto":  # GPUs: bfloat16 (float16 before Ampere)
            if self.device == "cuda":
                self.dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
            else:
                self.dtype = "bfloat16" if has_native_bfloat16() and not self.weights_run_in_integer_kernels() \
                    else "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype == "auto":
            self.kv_cache_dtype = "float16" if self.dtype == "float32" and self.device == "cpu" else self.dtype
        if self.device == "cuda" and self.kv_cache_dtype in DTYPES and self.kv_cache_dtype != self.dtype:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: on CUDA a float KV cache has the model dtype "
                             f"({self.dtype}); use 'auto'")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_memory",
                     "tensor_parallel_size", "pipeline_parallel_size"):
            if name == "kv_cache_memory" and self.kv_cache_memory is None:
                continue
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.quantization in ("int8", "int4", "w8a8") and self.tensor_parallel_size > 1:
            # these layers, quantized at load, hold whole weights and do no all-reduce ("auto" splits a GGUF file's
            # blocks across the ranks: loader/block_shards.py)
            raise ValueError("quantization is not supported with tensor_parallel_size > 1 "
                             "(pipeline_parallel_size > 1 is: each stage quantizes its own layers)")
        if self.device == "cuda" and self.quantization in ("int8", "int4", "w8a8"):
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU's kernels; on CUDA use 'auto' (a "
                             "GGUF file's blocks are dequantized to the model dtype) or None")
        if self.calibration is not None and self.quantization != "w8a8":
            raise ValueError(f"calibration is used only with quantization='w8a8', got quantization="
                             f"{self.quantization!r}")
        draft = self.speculative_config is not None and self.speculative_config.method == "draft_model"
        if self.quantization == "w8a8" and draft:
            raise ValueError("quantization='w8a8' with a draft model is not supported (the draft would need its "
                             "own calibration); use method 'ngram' or another quantization")
        if (self.speculative_config is not None and self.speculative_config.method == "eagle"
                and self.tensor_parallel_size * self.pipeline_parallel_size > 1):
            raise ValueError("an EAGLE head runs with the whole target on one process (it reads the final hidden "
                             "states of every position and the target's embedding and LM head): tensor_parallel_size "
                             "and pipeline_parallel_size must be 1 with method 'eagle'")
        if (self.speculative_config is not None and self.speculative_config.method in HEAD_METHODS
                and self.tensor_parallel_size > 1):
            raise ValueError("speculative heads run on rank 0 with the target's LM head, which tensor parallelism "
                             "splits: use pipeline_parallel_size instead of tensor_parallel_size")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be positive, got {self.distributed_timeout}")
        self._verify_kv_transfer()
        self._verify_lora()

    def _verify_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if not (value is None and name == "max_cpu_loras") and not is_positive_int(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.enable_lora and self.world_size > 1:
            raise ValueError("enable_lora is not supported with tensor_parallel_size or pipeline_parallel_size > 1 "
                             "yet (the adapters' A/B matrices are not split across ranks)")

    def _verify_kv_transfer(self) -> None:
        for name, allowed in (("kv_role", (None, *KV_ROLES)), ("kv_transfer_backend", KV_TRANSFER_BACKENDS),
                              ("kv_transfer_fallback", KV_TRANSFER_FALLBACKS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if self.kv_transfer_timeout <= 0:
            raise ValueError(f"kv_transfer_timeout must be positive, got {self.kv_transfer_timeout}")
        if not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_port must be a TCP port, got {self.kv_port}")
        if self.kv_role is not None and self.world_size > 1:
            raise ValueError("kv_role works on one process: it cannot be combined with tensor_parallel_size or "
                             "pipeline_parallel_size > 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def weights_run_in_integer_kernels(self) -> bool:
        """The projections run in the CPU's int4 / int8 kernels, which quantize their inputs to int8 themselves:
        int4, or "auto" on a GGUF file (the default model included) or an AWQ / GPTQ folder. dtype "auto" keeps
        float32 between them even where bfloat16 GEMMs are native: faster there (nothing to convert around the
        kernels), and it rounds less, as llama.cpp computes."""
        if self.quantization == "int4":
            return True
        if self.quantization != "auto":
            return False
        if self.model is None or self.model.endswith(".gguf"):
            return True
        config_file = os.path.join(self.model, "config.json")
        if not os.path.isfile(config_file):
            return False
        with open(config_file) as f:
            return "quantization_config" in json.load(f)

    @property
    def quantized_kv_cache(self) -> bool:
        return self.kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
