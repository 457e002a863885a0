"""Native CPU kernels, compiled on first use with torch.utils.cpp_extension for the CPU they run on (`-march=native`)
and registered as `torch.ops.inferno.*` operators. A build is cached under `kernel_cache_dir()` in a folder named
after the CPU and a digest of its sources and flags; a process that finds it loads the library directly (without
importing cpp_extension: about 0.15 s of every start-up). Without a compiler, or with INFERNO_DISABLE_CPP_KERNELS=1,
the plain PyTorch paths are used instead."""
import functools
import hashlib
import logging
import os
from pathlib import Path

import gguf
import torch

from inferno.cpu_features import cpu_key, isa_cflags

T = gguf.GGMLQuantizationType

logger = logging.getLogger("inferno")
KERNELS = Path(__file__).parent


def kernel_cache_dir() -> Path:
    """INFERNO_KERNEL_CACHE, else inferno/kernels under XDG_CACHE_HOME (~/.cache)."""
    if os.environ.get("INFERNO_KERNEL_CACHE"):
        return Path(os.environ["INFERNO_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inferno" / "kernels"


def extension_name(name: str, sources: tuple[str, ...], cflags: list[str]) -> str:
    """`name` keyed by the CPU and by what the build compiles: a `-march=native` build cached in the home folder,
    which can outlive the CPU it was built for (a home moved or shared between machines), is rebuilt on another CPU
    instead of dying there on an illegal instruction, and a changed source, header, flag or torch is rebuilt too."""
    digest = hashlib.sha256(" ".join([*cflags, torch.__version__]).encode())
    for path in [*(KERNELS / source for source in sources), *sorted(KERNELS.glob("*.h"))]:
        digest.update(path.read_bytes())
    return f"{name}_{cpu_key()}_{digest.hexdigest()[:12]}"


def _build(name: str, sources: tuple[str, ...], fallback: str, extra_cflags: tuple[str, ...] = ()) -> bool:
    """Load the cached build of `sources` (one library), or compile and load it (its operators register on load);
    False, with a warning, when that fails."""
    if os.environ.get("INFERNO_DISABLE_CPP_KERNELS") == "1":
        return False
    cflags = ["-O3", "-march=native", *isa_cflags(), *extra_cflags, "-fopenmp"]
    full_name = extension_name(name, sources, cflags)
    folder = kernel_cache_dir() / full_name
    library = folder / f"{full_name}.so"
    if library.is_file():
        try:
            torch.ops.load_library(str(library))
            return True
        except OSError:  # cut short (a build interrupted): build it again below
            pass
    try:
        from torch.utils import cpp_extension
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=full_name, sources=[str(KERNELS / source) for source in sources],
                           extra_cflags=cflags,
                           extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False,
                           verbose=False)
        return True
    except Exception as e:  # no compiler / ninja / headers: keep serving on the PyTorch path
        logger.warning("native kernel %s unavailable (%s: %s); %s", " + ".join(sources), type(e).__name__,
                       str(e).splitlines()[0] if str(e) else "", fallback)
        return False


@functools.cache
def paged_attention():
    """The `torch.ops.inferno` namespace holding `paged_decode_attention` and `paged_prefill_attention`, or None
    when they cannot be built."""
    if not _build("inferno_paged_attention_op", ("paged_attention.cpp", "prefill_attention.cpp"),
                  "using the PyTorch attention path"):
        return None

    @torch.library.register_fake("inferno::paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale, window=0):  # shapes for torch.compile's tracing
        return torch.empty_like(q)

    @torch.library.register_fake("inferno::paged_prefill_attention")
    def _(q, k, v, k_cache, v_cache, block_table, num_computed, scale, window=0):
        return torch.empty_like(q)

    return torch.ops.inferno


TILE_ROWS = 16  # weight rows per tile of q4_k_tile, q6_k_tile and int4_tile (quantized_rows.h)


@functools.cache
def quantized_gemv():
    """The `torch.ops.inferno` namespace holding `int8_group_matmul` (float32 rows times group-wise int8 weights),
    `int8_group_dequantize`, `int8_q8_matmul` / `int4_q8_matmul` (rows quantized to int8 times signed int8 groups
    of 16 or 32 / group-wise int4) and their float32 / bfloat16 dequantizers `int8_q8_dequantize` /
    `int4_dequantize`, and the int4 and Q8 tiles `int4_tile` / `int4_tiles_matmul` / `q8_tile` / `q8_tiles_matmul`
    (see quantized_gemv.cpp), or None when they cannot be built."""
    if not _build("inferno_quantized_gemv", ("quantized_gemv.cpp",), "using dequantize + F.linear",
                  ("-ffp-contract=fast",)):
        return None

    @torch.library.register_fake("inferno::int8_group_matmul")
    def _(x, codes, scales, mins, group_size):  # shapes for torch.compile's tracing
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("inferno::int8_group_dequantize")
    def _(codes, scales, mins, group_size):
        return scales.new_empty(codes.shape)

    @torch.library.register_fake("inferno::int8_q8_matmul")
    def _(x, codes, scales, mins, group_size):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("inferno::int4_q8_matmul")
    def _(x, packed, group_size, zero_points=False):
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("inferno::int4_dequantize")
    def _(packed, k, group_size, dtype, zero_points=False):
        return packed.new_empty(packed.shape[0], k, dtype=dtype)

    @torch.library.register_fake("inferno::int8_q8_dequantize")
    def _(codes, scales, mins, group_size, dtype):
        return scales.new_empty(codes.shape, dtype=dtype)

    @torch.library.register_fake("inferno::int4_tiles_matmul")
    def _(x, tiles, zero_points=False):
        return x.new_empty(x.shape[0], tiles.shape[0] * TILE_ROWS)

    @torch.library.register_fake("inferno::q8_tiles_matmul")
    def _(x, tiles):
        return x.new_empty(x.shape[0], tiles.shape[0] * TILE_ROWS)

    return torch.ops.inferno




def _super_block_gemv(qtype: T) -> bool:
    """Builds `{type}_matmul` (rows quantized to int8 times GGUF K-quant super-blocks as stored),
    `{type}_dequantize` (to float32 / bfloat16), `{type}_tile` and `{type}_tiles_matmul` from `{type}_gemv.cpp`,
    with their shapes for torch.compile."""
    op = qtype.name.lower()
    if not _build(f"inferno_{op}_gemv", (f"{op}_gemv.cpp",), "using dequantize + F.linear"):
        return False
    values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]

    @torch.library.register_fake(f"inferno::{op}_matmul")
    def _(x, blocks):
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake(f"inferno::{op}_dequantize")
    def _(blocks, dtype):
        return blocks.new_empty(blocks.shape[0], blocks.shape[1] // block_bytes * values, dtype=dtype)

    @torch.library.register_fake(f"inferno::{op}_tiles_matmul")
    def _(x, tiles):
        return x.new_empty(x.shape[0], tiles.shape[0] * TILE_ROWS)

    return True


@functools.cache
def q6_k_gemv():
    """The `torch.ops.inferno` namespace holding `q6_k_matmul`, `q6_k_dequantize`, `q6_k_tile` and
    `q6_k_tiles_matmul` (see q6_k_gemv.cpp), or None when they cannot be built."""
    return torch.ops.inferno if _super_block_gemv(T.Q6_K) else None


@functools.cache
def q4_k_gemv():
    """The `torch.ops.inferno` namespace holding `q4_k_matmul`, `q4_k_dequantize`, `q4_k_tile` and
    `q4_k_tiles_matmul` (see q4_k_gemv.cpp), or None when they cannot be built."""
    return torch.ops.inferno if _super_block_gemv(T.Q4_K) else None


# the types whose blocks carry a min: gguf_to_q8 returns their mins (an empty tensor for the others)
Q8_WITH_MINS = {T.Q4_1, T.Q4_K, T.Q5_1, T.Q5_K}


@functools.cache
def gguf_repack():
    """The `torch.ops.inferno` namespace holding `gguf_to_int4` and `gguf_to_q8` (raw GGUF blocks -> the int4
    kernel's rows / Q8Groups' codes, scales and mins, see gguf_repack.cpp), or None when they cannot be built."""
    if not _build("inferno_gguf_repack", ("gguf_repack.cpp",), "repacking GGUF blocks with PyTorch ops"):
        return None

    @torch.library.register_fake("inferno::gguf_to_q8")
    def _(raw, qtype):  # shapes for torch.compile's tracing (an embedding converts the rows it looks up)
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[T(qtype)]
        k = raw.shape[1] // block_bytes * block_values
        scales = raw.new_empty(raw.shape[0], k // (16 if qtype == T.Q6_K else 32), dtype=torch.float)
        return (raw.new_empty(raw.shape[0], k, dtype=torch.int8), scales,
                torch.empty_like(scales) if qtype in Q8_WITH_MINS else raw.new_empty(0, dtype=torch.float))

    return torch.ops.inferno



@functools.cache
def w8a8_activations():
    """The `torch.ops.inferno` namespace holding `w8a8_quantize_rows` (a W8A8 projection's input scaled, rotated and
    quantized to bytes in one pass) and `w8a8_scale_rows` (its GEMM's output times the row scales, plus the bias, in
    the model's dtype; see w8a8_activations.cpp), or None when they cannot be built."""
    if not _build("inferno_w8a8_activations", ("w8a8_activations.cpp",), "quantizing activations with PyTorch ops"):
        return None

    @torch.library.register_fake("inferno::w8a8_quantize_rows")
    def _(x, input_scales, rotation_block):
        return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape[0], 1, dtype=torch.float)

    @torch.library.register_fake("inferno::w8a8_scale_rows")
    def _(y, row_scales, bias, out):
        return None

    return torch.ops.inferno


@functools.cache
def fused_ops():
    """The `torch.ops.inferno` namespace holding the fused elementwise steps of CPU steps: `rms_norm`,
    `add_rms_norm`, `silu_and_mul` and `rotary` (see fused_ops.cpp), or None when they cannot be built."""
    if not _build("inferno_fused_ops", ("fused_ops.cpp",), "using PyTorch's elementwise operators"):
        return None

    @torch.library.register_fake("inferno::rms_norm")
    def _(x, weight, eps):  # shapes for torch.compile's tracing
        return torch.empty_like(x)

    @torch.library.register_fake("inferno::add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("inferno::silu_and_mul")
    def _(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("inferno::rotary")
    def _(x, rotations):
        return x.new_empty(x.shape)

    return torch.ops.inferno
