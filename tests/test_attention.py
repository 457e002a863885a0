"""Paged decode attention: the native kernel and the PyTorch gather path agree with dense SDPA."""
import pytest
import torch
import torch.nn.functional as F

from inferno.kernels import paged_attention
from inferno.layers.attention import Attention, DecodeGroup, block_rows

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 9, 3, 64, 16, 200


def random_batch(dtype: torch.dtype, seq_lens: list[int]):
    torch.manual_seed(0)
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM)
    attn.k_cache = torch.randn(KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM, dtype=dtype)
    attn.v_cache = torch.randn(KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM, dtype=dtype)
    width = max(-(-n // BLOCK) for n in seq_lens)
    tables = torch.stack([torch.randperm(NUM_BLOCKS)[:width] for _ in seq_lens])
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM, dtype=dtype)
    return attn, q, tables, torch.tensor(seq_lens)


def dense_reference(attn: Attention, q, tables, seq_lens) -> torch.Tensor:
    out = []
    for b, n in enumerate(seq_lens.tolist()):
        k = attn.k_cache[:, tables[b]].reshape(KV_HEADS, -1, HEAD_DIM)[:, :n].float()
        v = attn.v_cache[:, tables[b]].reshape(KV_HEADS, -1, HEAD_DIM)[:, :n].float()
        out.append(F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, enable_gqa=True).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("path", ["kernel", "gather"])
# one long sequence and a short one beside a long one: the kernel splits them over threads (flash-decoding)
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 100, 333], [1000], [3, 700]])
def test_decode_attention_matches_dense(path, dtype, tol, lens):
    attn, q, tables, seq_lens = random_batch(dtype, lens)
    group = DecodeGroup(0, len(seq_lens), tables, seq_lens)
    if path == "kernel":
        if paged_attention() is None:
            pytest.skip("no C++ compiler: the native kernel is not built")
        out = attn._decode(q, group)
    else:
        group.block_rows = block_rows(tables, KV_HEADS, NUM_BLOCKS)
        group.mask = (torch.arange(tables.shape[1] * BLOCK).unsqueeze(0) < seq_lens.unsqueeze(1))[None, :, None, :]
        out = attn._decode(q, group)
    assert out.dtype == dtype
    assert (out.float() - dense_reference(attn, q, tables, seq_lens)).abs().max().item() < tol
