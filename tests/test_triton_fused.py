"""The fused Triton operators (the GPU path) agree with the PyTorch ops they replace: on CUDA when there is a GPU,
else on a CPU under Triton's interpreter."""
import pytest
import torch
import torch.nn.functional as F

fused = pytest.importorskip("inferno.kernels.triton_fused", reason="triton is not installed")
from inferno.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("size", [64, 96])
def test_add_rms_norm(dtype, tol, size):
    torch.manual_seed(0)
    x, residual = torch.randn(5, size).to(DEVICE, dtype), torch.randn(5, size).to(DEVICE, dtype)
    weight = (1 + 0.3 * torch.randn(size)).to(DEVICE, dtype)
    out, total = fused.fused_add_rms_norm(x, weight, 1e-6, residual)
    ref_total = x + residual
    ref = weight * F.rms_norm(ref_total.float(), (size,), None, 1e-6).to(dtype)
    assert torch.equal(total, ref_total)
    assert (out.float() - ref.float()).abs().max().item() < tol
    alone, same = fused.fused_add_rms_norm(x, weight, 1e-6)
    assert same is x
    assert (alone.float() - (weight * F.rms_norm(x.float(), (size,), None, 1e-6).to(dtype)).float()).abs().max() < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_silu_and_mul(dtype, tol):
    torch.manual_seed(1)
    gate_up = torch.randn(4, 2 * 1500).to(DEVICE, dtype)  # more than one column block per row
    gate, up = gate_up.chunk(2, dim=-1)
    assert (fused.silu_and_mul(gate_up).float() - (F.silu(gate) * up).float()).abs().max().item() < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_rotary_in_place_on_a_strided_view(dtype, tol):
    torch.manual_seed(2)
    rotary = RotaryEmbedding(64, 256, 10000.0)
    qkv = torch.randn(6, 4 + 2 + 2, 64).to(dtype)  # q and k as views of a fused projection, as in the model
    positions = torch.tensor([0, 1, 5, 100, 200, 255])
    ref = apply_rotary(qkv[:, :6].clone(), rotary.rotations(positions))
    rotated = qkv.to(DEVICE)
    fused.rotary_(rotated[:, :6], rotary.rotations(positions).to(DEVICE))
    assert (rotated[:, :6].cpu().float() - ref.float()).abs().max().item() < tol
