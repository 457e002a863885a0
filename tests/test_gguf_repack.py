"""The native GGUF repack (kernels/gguf_repack.cpp) against the PyTorch path of loader/gguf_blocks.py, bit for bit:
the int4 layout from Q4_0 / Q4_1 and Q8Groups from every type, on odd row counts and on a K whose last chunk
of the int4 layout is partial (fewer than 16 blocks of 32)."""
import gguf
import numpy as np
import pytest
import torch

from inferno.layers.quantization.int4 import Int4Linear, pack_int4
from inferno.layers.quantization.groups import GroupQuantized
from inferno.loader.gguf_blocks import (INT4_TYPES, Q8_TYPES, int4_groups, int4_rows, pack_int4_shards, q8_groups,
                                        q8_groups_reference)
from native_kernels import EACH_ISA_LEVEL, isa_level_run, needs_kernels
from tiny_gguf import T, random_blocks

pytestmark = needs_kernels

# (rows, columns): one row; odd rows with K = 21 or 24 blocks of 32 (a chunk of 16, then a partial one); 2 full chunks
SHAPES = [(1, 256), (7, 768), (13, 512 * 2)]


def columns(qtype: T, cols: int) -> int:
    """`cols`, or 672 (21 blocks: a partial chunk) for the types with blocks of 32."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return 672 if block == 32 and cols == 768 else cols


def raw_blocks(qtype: T, rows: int, cols: int, valid: bool) -> np.ndarray:
    """Valid blocks, or every byte random (float16 scales anywhere in their range: subnormals, inf, NaN)."""
    rng = np.random.default_rng(int(qtype) * 1000 + rows)
    if valid:
        return random_blocks(qtype, rows, cols, rng)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (their payloads are not specified)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    both_nan = a.isnan() & b.isnan()
    bits = torch.int32 if a.element_size() == 4 else torch.int16
    return torch.equal(a.view(bits)[~both_nan], b.view(bits)[~both_nan])


def same_packed(a: torch.Tensor, b: torch.Tensor, k: int) -> bool:
    """Packed int4 rows: the codes byte for byte, the float16 scales and mins bit for bit (NaN as NaN)."""
    return torch.equal(a[:, :k // 2], b[:, :k // 2]) and \
        same_bits(a[:, k // 2:].contiguous().view(torch.float16), b[:, k // 2:].contiguous().view(torch.float16))


@pytest.mark.parametrize("valid", [True, False], ids=["valid", "random-bytes"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", INT4_TYPES, ids=lambda t: t.name)
def test_native_int4_rows_equal_the_pytorch_packing(qtype, shape, valid):
    rows, cols = shape[0], columns(qtype, shape[1])
    raw = raw_blocks(qtype, rows, cols, valid)
    native = pack_int4_shards([int4_rows(raw, qtype)])
    expected = pack_int4(int4_groups(raw, qtype))
    assert native.shape == (rows, cols) and native.packed.dtype == torch.uint8
    assert same_packed(native.packed, expected, cols)


@pytest.mark.parametrize("valid", [True, False], ids=["valid", "random-bytes"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda t: t.name)
def test_native_q8_groups_equal_the_pytorch_decoding(qtype, shape, valid):
    rows, cols = shape[0], columns(qtype, shape[1])
    raw = raw_blocks(qtype, rows, cols, valid)
    native, expected = q8_groups(raw, qtype), q8_groups_reference(raw, qtype)
    assert same_bits(native.codes, expected.codes) and same_bits(native.scales, expected.scales)
    assert (native.mins is None) == (expected.mins is None)
    assert native.mins is None or same_bits(native.mins, expected.mins)
    if valid:
        assert np.array_equal(native.dequantize().numpy(), gguf.quants.dequantize(raw, qtype))


@EACH_ISA_LEVEL
def test_each_isa_level_repacks_the_same_bits(tmp_path, level):
    """gguf_repack.cpp as each level's library builds it: Q8Groups of every type as PyTorch decodes them."""
    raws = {int(qtype): torch.from_numpy(raw_blocks(qtype, 7, columns(qtype, 768), True)) for qtype in Q8_TYPES}
    code = "outputs = {qtype: torch.ops.inferno.gguf_to_q8(raw, qtype) for qtype, raw in inputs.items()}"
    outputs = isa_level_run(tmp_path, level, code, raws)
    for qtype, raw in raws.items():
        expected = q8_groups_reference(raw.numpy(), T(qtype))
        codes, scales, mins = outputs[qtype]
        assert same_bits(codes, expected.codes) and same_bits(scales, expected.scales)
        assert same_bits(mins, expected.mins) if expected.mins is not None else mins.numel() == 0


@pytest.mark.parametrize("qtype", INT4_TYPES, ids=lambda t: t.name)
def test_shards_permute_and_stack_like_codes(qtype):
    """A row permutation of the file's rows (the rotary order of Q/K) and the shards of a fused layer packed into one
    tensor give the packing of the permuted, stacked codes; the kept rows give the permuted Q8 form."""
    a, b = raw_blocks(qtype, 8, 512, valid=True), raw_blocks(qtype, 5, 512, valid=False)
    order = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4])
    shard = int4_rows(a, qtype).map_rows(lambda t: t[order])
    native = pack_int4_shards([shard, int4_rows(b, qtype)])
    expected = pack_int4(GroupQuantized.cat([int4_groups(a, qtype).map_rows(lambda t: t[order]),
                                             int4_groups(b, qtype)]))
    assert native.shape == (13, 512) and same_packed(native.packed, expected, 512)
    assert torch.equal(shard.q8_groups().codes, q8_groups_reference(a[order.numpy()], qtype).codes)
    layer = Int4Linear(native, None)
    assert torch.equal(layer.weight, native.packed) and layer.padded_in_features == 512


def test_unsupported_type_is_refused_with_a_clear_error():
    with pytest.raises(RuntimeError, match="gguf_to_int4 takes Q4_0 or Q4_1"):
        torch.ops.inferno.gguf_to_int4(torch.zeros(2, 34, dtype=torch.uint8), int(T.Q8_0),
                                       torch.empty(2, 24, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="packed must be contiguous uint8"):
        torch.ops.inferno.gguf_to_int4(torch.zeros(2, 18, dtype=torch.uint8), int(T.Q4_0),
                                       torch.empty(2, 15, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="not a whole number of"):
        torch.ops.inferno.gguf_to_q8(torch.zeros(2, 35, dtype=torch.uint8), int(T.Q8_0))
