"""The native LoRA product (kernels/lora_bgmv.cpp, `LoRAStack`'s CPU path up to SEGMENTED_FROM_ROWS rows) against the
masked PyTorch product it replaces and a float64 product row by row: rows of several slots and of slot 0 (no
adapter) mixed, ranks below the stack's rank, fused slices with one not adapted, widths with tails shorter than a
vector; float32, bfloat16 and float16; each ISA level's build."""
import pytest
import torch

from inferno.kernels import native_ops
from inferno.layers.lora import SEGMENTED_FROM_ROWS, LoRAMapping, LoRAStack
from native_kernels import EACH_ISA_LEVEL, isa_level_run, needs_kernels

pytestmark = needs_kernels
CPU = torch.device("cpu")
# (in_features, slice sizes): fused q/k/v with tails (100 columns in, 40 + 24 + 24 out), and one slice of whole
# chunks of columns
SHAPES = {"qkv": (100, [40, 24, 24]), "down": (256, [128])}


def filled_stack(in_features: int, slice_sizes: list[int], dtype: torch.dtype = torch.float32) -> LoRAStack:
    """5 slots of rank 8: slot 1 every slice at rank 8, slot 2 rank 3 with the second slice not adapted, slot 3 the
    last slice only, slot 4 empty; A ~ N(0, 1 / in), B ~ N(0, 0.3²)."""
    stack = LoRAStack(in_features, slice_sizes, num_slots=5, max_rank=8, dtype=dtype, device=CPU)
    generator = torch.Generator().manual_seed(in_features)

    def pair(rank: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(rank, in_features, generator=generator) / in_features ** 0.5,
                0.3 * torch.randn(out, rank, generator=generator))

    last = len(slice_sizes) - 1
    stack.set_slot(1, [pair(8, size) for size in slice_sizes])
    stack.set_slot(2, [None if i == 1 else pair(3, size) for i, size in enumerate(slice_sizes)])
    stack.set_slot(3, [pair(8, size) if i == last else None for i, size in enumerate(slice_sizes)])
    return stack


def row_by_row(stack: LoRAStack, x: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    """(x[t] A[s]^T) B[s] for each row in float64, zero for slot 0."""
    a, b = stack.lora_a.double(), stack.lora_b.double()
    return torch.stack([(x[t].double() @ a[s].t()) @ b[s] * (s != 0) for t, s in enumerate(token_slots)])


def mixed_slots(rows: int) -> list[int]:
    return [(3 * t + t // 4) % 4 for t in range(rows)]  # slots 0..3 interleaved; slot 4 never


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 5, SEGMENTED_FROM_ROWS, 130])
def test_native_product_matches_masked_and_row_by_row(shape, rows):
    in_features, slices = SHAPES[shape]
    stack = filled_stack(in_features, slices)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    slots = mixed_slots(rows)
    token_slots = torch.tensor(slots)
    got = stack._native(native_ops(), x, token_slots)
    assert got.shape == (rows, sum(slices)) and got.dtype == torch.float32
    assert got[token_slots == 0].eq(0).all()
    torch.testing.assert_close(got, stack._masked(x, token_slots), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), row_by_row(stack, x, slots), rtol=1e-5, atol=1e-5)


def test_one_adapter_and_base_rows_only():
    """A batch-1 step with an adapter, and a step whose rows all run the base model (every row zero)."""
    stack = filled_stack(*SHAPES["qkv"])
    x = torch.randn(3, SHAPES["qkv"][0])
    for slots in ([2], [0, 0, 0]):
        token_slots = torch.tensor(slots)
        got = stack._native(native_ops(), x[:len(slots)], token_slots)
        torch.testing.assert_close(got.double(), row_by_row(stack, x, slots), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_stacks_match_the_float64_product(dtype):
    """x, A and B in 16 bits; the kernel sums in float32 and rounds the output once."""
    stack = filled_stack(*SHAPES["qkv"], dtype=dtype)
    x = torch.randn(9, SHAPES["qkv"][0]).to(dtype)
    slots = mixed_slots(9)
    got = stack._native(native_ops(), x, torch.tensor(slots))
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), row_by_row(stack, x, slots), rtol=1e-2, atol=1e-2)


def test_stack_runs_the_native_product_up_to_the_segmented_rows(monkeypatch):
    rows_run = []
    native = LoRAStack._native

    def counted_native(self, ops, x, token_slots):
        rows_run.append(x.shape[0])
        return native(self, ops, x, token_slots)

    monkeypatch.setattr(LoRAStack, "_native", counted_native)
    stack = filled_stack(*SHAPES["qkv"])
    for rows in (7, SEGMENTED_FROM_ROWS + 1):
        x = torch.randn(rows, SHAPES["qkv"][0])
        slots = mixed_slots(rows)
        got = stack(x, LoRAMapping.of(slots, CPU))
        torch.testing.assert_close(got.double(), row_by_row(stack, x, slots), rtol=1e-5, atol=1e-5)
    assert rows_run == [7]  # more rows run per segment


def test_bad_calls_are_refused():
    stack = filled_stack(*SHAPES["qkv"])
    x = torch.randn(2, SHAPES["qkv"][0])
    ops = native_ops()
    with pytest.raises(RuntimeError, match="is not a slot"):
        ops.lora_bgmv(x, stack.lora_a, stack.lora_b, torch.tensor([1, 5]), stack.slice_sizes)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.lora_bgmv(x.bfloat16(), stack.lora_a, stack.lora_b, torch.tensor([1, 0]), stack.slice_sizes)
    with pytest.raises(RuntimeError, match="lora_b must be"):
        ops.lora_bgmv(x, stack.lora_a, stack.lora_b, torch.tensor([1, 0]), [40, 24, 23])
    with pytest.raises(RuntimeError, match="one int64 per row"):
        ops.lora_bgmv(x, stack.lora_a, stack.lora_b, torch.tensor([1]), stack.slice_sizes)


@EACH_ISA_LEVEL
def test_each_isa_level_matches_the_float64_product(tmp_path, level):
    """The 16-lane path (AVX-512), the 8-lane one (AVX2 + FMA + F16C) and the plain loops."""
    stacks = [filled_stack(*SHAPES[shape]) for shape in SHAPES] + [filled_stack(*SHAPES["qkv"], torch.bfloat16)]
    xs = [torch.randn(11, stack.lora_a.shape[2]).to(stack.lora_a.dtype) for stack in stacks]
    slots = mixed_slots(11)
    code = ("stacks, xs, slots, slices = inputs\n"
            "outputs = [torch.ops.inferno.lora_bgmv(x, a, b, slots, sizes) for (a, b), x, sizes in "
            "zip(stacks, xs, slices)]")
    inputs = ([(s.lora_a, s.lora_b) for s in stacks], xs, torch.tensor(slots), [s.slice_sizes for s in stacks])
    outputs = isa_level_run(tmp_path, level, code, inputs)
    for stack, x, got in zip(stacks, xs, outputs):
        tol = 1e-5 if got.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), row_by_row(stack, x, slots), rtol=tol, atol=tol)
