"""Fused elementwise operators in Triton (the GPU path; on a CPU they run under Triton's interpreter in tests):
one read and one write of each activation instead of one per PyTorch op.

- `fused_add_rms_norm`: residual add and RMSNorm in one pass (the sum kept as the next residual).
- `silu_and_mul`: SwiGLU's silu(gate) * up from the fused gate/up projection.
- `rotary_`: rotary embedding in place on q or k (interleaved pairs), by each token's (cos, sin) table.
Statistics in float32, results rounded to the input dtype where the PyTorch ops round them.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, size, eps, stride_x, stride_r,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)  # the sum rounded to the model dtype, as `x + residual` is
        tl.store(sum_ptr + row * size + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / size + eps)
    normed = (xf * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * size + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for x [T, size]; without `residual`, (rms_norm(x) * weight, x)."""
    rows, size = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = torch.empty_like(out) if residual is not None else x
    if rows:
        _add_rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, total, size, eps,
                                      x.stride(0), residual.stride(0) if residual is not None else 0,
                                      HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(size))
    return out, total


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inner, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu rounds its result
    tl.store(out_ptr + row * inner + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inner] (gate, then up) -> silu(gate) * up, [T, inner]."""
    rows, width = gate_up.shape
    inner = width // 2
    out = gate_up.new_empty(rows, inner)
    block = min(triton.next_power_of_2(inner), 1024)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(inner, block))](gate_up, out, inner, gate_up.stride(0), BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(x_ptr, cos_sin, stride_t, stride_h, num_heads, half,
                   BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    p = tl.arange(0, BLOCK_P)
    pm = p < half
    cos = tl.load(cos_sin + t * half * 2 + p * 2, mask=pm, other=1.0)
    sin = tl.load(cos_sin + t * half * 2 + p * 2 + 1, mask=pm, other=0.0)
    mask = (h < num_heads)[:, None] & pm[None, :]
    base = x_ptr + t * stride_t + h[:, None] * stride_h + 2 * p[None, :]
    x0 = tl.load(base, mask=mask, other=0.0)
    x1 = tl.load(base + 1, mask=mask, other=0.0)
    f0, f1 = x0.to(tl.float32), x1.to(tl.float32)
    tl.store(base, (f0 * cos[None, :] - f1 * sin[None, :]).to(x0.dtype), mask=mask)
    tl.store(base + 1, (f0 * sin[None, :] + f1 * cos[None, :]).to(x0.dtype), mask=mask)


def rotary_(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (interleaved pairs, head_dim contiguous) in place by each token's
    rotations [T, 1, head_dim // 2, 2] (cos, sin; float32, contiguous: RotaryEmbedding.rotations)."""
    tokens, heads, head_dim = x.shape
    if tokens:
        _rotary_kernel[(tokens,)](x, rotations, x.stride(0), x.stride(1), heads, head_dim // 2,
                                  BLOCK_H=triton.next_power_of_2(heads), BLOCK_P=triton.next_power_of_2(head_dim // 2))
    return x
