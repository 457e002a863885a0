"""EAGLE heads (Li et al. 2024, EAGLE-1/2): one decoder layer of the target's architecture over
`fc([embed(token at p + 1); feature at p])`, where the feature is the target's final hidden state (after its final
norm) at position p. The layer has no input norm (the fc output goes straight into attention, as in the reference
and vLLM's / SGLang's llama_eagle); its output, without a final norm, is the head's own feature for position p:
the target's LM head maps it to the token at p + 2, and it stands in for the target's feature at p + 1 when the head
runs on to its next draft. The embedding is always the target's; the LM head too unless the folder has its own,
which may cover a draft vocabulary (EAGLE-3's, vLLM's and SGLang's `draft_vocab_size`): a subset of the target's
tokens, `draft_to_target` their target ids. The fc and the own LM head compute through `packed_linear.linear`, as
the layer's projections do: on the CPU on the oneDNN copies the proposer makes at load (worker/spec_decode/eagle.py).
The head may run in another dtype than the target (bfloat16 for a float32 one on the CPU): it takes the target's
embeddings and features in theirs and gives its own back in them."""
import torch
import torch.nn.functional as F
from torch import nn

from inferno.config import ModelConfig
from inferno.distributed.parallel_state import SINGLE
from inferno.layers.packed_linear import linear
from inferno.layers.rotary import RotaryEmbedding, apply_rotary
from inferno.model.llama import DecoderLayer


class EagleHead(nn.Module):
    """`config`: the head's layer's shape (the target's architecture, one layer, no sliding window or experts)."""

    def __init__(self, config: ModelConfig, fc_bias: bool, own_lm_head: bool, draft_vocab_size: int | None = None):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(config, 0, SINGLE)])
        self.layers[0].input_layernorm = nn.Identity()
        self.lm_head = nn.Linear(hidden, draft_vocab_size or config.vocab_size, bias=False) if own_lm_head else None
        self.register_buffer("draft_to_target", None, persistent=False)  # [draft vocabulary] target ids, or None
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)

    @property
    def attention(self):
        return self.layers[0].self_attn.attn

    def holds(self, name: str) -> bool:
        """Every checkpoint tensor of the head is this module's (model_loader.load_weights asks)."""
        return True

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The head's features [T, hidden] over a flat batch on its paged KV cache: `embeds` of the tokens at p + 1,
        `features` (the target's, or the head's own while drafting) at p, `positions` p."""
        x = linear(torch.cat([embeds, features], dim=-1).to(self.fc.weight.dtype), self.fc.weight, self.fc.bias)
        out, residual = self.layers[0](x, None, self.rotary.rotations(positions), meta)
        return (out + residual).to(features.dtype)

    def set_draft_vocabulary(self, target_ids: torch.Tensor) -> None:
        """The target ids of the LM head's rows (ascending)."""
        if self.lm_head is None or target_ids.shape != (self.lm_head.out_features,):
            raise ValueError(f"a draft vocabulary of {len(target_ids)} tokens needs an own LM head of as many rows")
        self.draft_to_target = target_ids.long().to(self.fc.weight.device)

    def logits(self, features: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Float32 logits over the target's vocabulary of the token two positions after each feature's (-inf
        outside a draft vocabulary)."""
        logits = (target_lm_head(features) if self.lm_head is None
                  else linear(features.to(self.lm_head.weight.dtype), self.lm_head.weight)).float()
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_to_target, logits)

    def forward_dense(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The same features for whole sequences [B, T, hidden] (positions 0..T-1, causal), without a KV cache and
        differentiable: for training (plain PyTorch ops only; float32)."""
        layer, config = self.layers[0], self.config
        attn = layer.self_attn
        x = self.fc(torch.cat([embeds, features], dim=-1))
        b, t, _ = x.shape
        qkv = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias).view(b, t, -1, config.head_dim)
        q, k, v = qkv.split([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=2)
        if attn.q_norm is not None:
            if attn.q_norm.weight.shape[0] != config.head_dim:
                raise ValueError("training EAGLE heads needs per-head q/k norms or none")
            q, k = (_rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm))
        rotations = self.rotary.rotations(torch.arange(t))
        q, k = (apply_rotary(z.flatten(0, 1), rotations.repeat(b, 1, 1, 1)).view(z.shape) for z in (q, k))
        scale = attn.attn.scale
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             scale=scale, enable_gqa=attn.num_heads != attn.num_kv_heads)
        x = x + F.linear(out.transpose(1, 2).flatten(2), attn.o_proj.weight, attn.o_proj.bias)
        if layer.pre_feedforward_layernorm is not None or not hasattr(layer.mlp, "gate_up_proj"):
            raise ValueError("training EAGLE heads supports Llama-shaped layers (one norm before a dense MLP)")
        mlp = layer.mlp
        gate, up = F.linear(_rms_norm(x, layer.post_attention_layernorm), mlp.gate_up_proj.weight).chunk(2, dim=-1)
        return x + F.linear(mlp.act(gate) * up, mlp.down_proj.weight)


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
