"""The fused native CPU elementwise kernels (kernels/fused_ops.cpp) against the PyTorch operators they replace in
eager steps: RMSNorm with and without the residual add, SiLU-and-multiply, rotary of q and k (views of the QKV
buffer); float32, bfloat16 and float16 rows, widths with a tail shorter than a vector; and the AVX2 build."""
import pytest
import torch
import torch.nn.functional as F

from inferno.kernels import fused_ops
from inferno.layers.norm import RMSNorm
from inferno.layers.rotary import apply_rotary
from native_kernels import EACH_ISA_LEVEL, isa_level_run, needs_kernels

pytestmark = needs_kernels
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def pytorch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers/norm.py's PyTorch path."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-signed values of a 16-bit dtype."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [576, 200])  # 200: a tail shorter than a vector
def test_rms_norm_matches_pytorch(dtype, size):
    torch.manual_seed(size)
    x, residual = torch.randn(37, size).to(dtype), torch.randn(37, size).to(dtype)
    weight = (torch.rand(size) + 0.5).to(dtype)
    out, total = fused_ops().add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, residual + x)  # the residual stream is exactly the PyTorch sum
    for got, want in ((out, pytorch_norm(residual + x, weight, 1e-6)),
                      (fused_ops().rms_norm(x, weight, 1e-6), pytorch_norm(x, weight, 1e-6))):
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        else:  # the sum of squares in another order: a normalised value may round the other way
            assert max_ulps(got, want) <= 1


def test_rms_norm_layer_uses_the_kernel_in_eager_steps():
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.rand(64) + 0.5
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    h, total = norm.add_and_norm(x, residual)
    torch.testing.assert_close(h, pytorch_norm(residual + x, norm.weight, 1e-5), rtol=2e-6, atol=2e-6)
    assert norm._fused(x) is not None and norm._fused(x.t()) is None  # a strided view stays on PyTorch's path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [1536, 100])
def test_silu_and_mul_matches_pytorch(dtype, inner):
    torch.manual_seed(inner)
    gate_up = (torch.randn(21, 2 * inner) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = F.silu(gate) * up  # in float32, rounded once: the kernel rounds once too
    got = fused_ops().silu_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == (21, inner)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert max_ulps(got, want.to(dtype)) <= 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 6])  # 80: a tail of half a vector (AVX-512); 6: scalar only
def test_rotary_matches_pytorch(dtype, head_dim):
    """q and k as the decoder has them: views of the QKV buffer, rotated into new tensors; the buffer untouched."""
    torch.manual_seed(head_dim)
    qkv = torch.randn(13, 9 + 3 + 3, head_dim).to(dtype)
    rotations = torch.randn(13, 1, head_dim // 2, 2)
    q, k, v = qkv.split([9, 3, 3], dim=1)
    before = qkv.clone()
    got_q, got_k = fused_ops().rotary(q, rotations), fused_ops().rotary(k, rotations)
    assert got_q.is_contiguous() and got_q.shape == q.shape and got_q.dtype == dtype
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got_q.float(), apply_rotary(q, rotations).float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_k.float(), apply_rotary(k, rotations).float(), rtol=tol, atol=tol)
    assert torch.equal(qkv, before)


@EACH_ISA_LEVEL
def test_each_isa_level_matches_pytorch(tmp_path, level):
    """The 16-lane path (AVX-512), the 8-lane one (AVX2 + FMA + F16C) and the plain loops."""
    torch.manual_seed(0)
    x, residual, weight = torch.randn(7, 200), torch.randn(7, 200), torch.rand(200) + 0.5
    gate_up = torch.randn(7, 2 * 100).bfloat16()
    qk = torch.randn(7, 4, 80).half()
    rotations = torch.randn(7, 1, 40, 2)
    code = ("x, r, w, gu, qk, rot = inputs\nops = torch.ops.inferno\n"
            "outputs = (ops.add_rms_norm(x, r, w, 1e-6), ops.silu_and_mul(gu), ops.rotary(qk, rot))")
    (out, total), silu, rotated = isa_level_run(tmp_path, level, code, (x, residual, weight, gate_up, qk, rotations))
    assert torch.equal(total, residual + x)
    torch.testing.assert_close(out, pytorch_norm(residual + x, weight, 1e-6), rtol=2e-6, atol=2e-6)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert max_ulps(silu, (F.silu(gate) * up).bfloat16()) <= 1
    torch.testing.assert_close(rotated.float(), apply_rotary(qk, rotations).float(), rtol=2e-3, atol=2e-3)
