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
        return self.forward_steps(embeds, features, 1)[0]

    def forward_steps(self, embeds: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The head's features [B, T, hidden] at each of `steps` unrolled draft steps over whole sequences, as
        `forward_dense` (EAGLE-3's "training-time test"). Step 1 reads the target's features; step j > 1 reads, at
        position p, the head's own step j - 1 output at p - 1 (as draft j does while proposing: it stands in for the
        target's feature there; zeros at p = 0) and attends to what that draft's pass sees on the head's KV cache:
        step 1's keys at positions up to p - j + 1 (the catch-up's, from the target's features), then step i's key
        at p - j + i for i = 2..j (the earlier drafts' passes). `embeds` stay the tokens at p + 1 at every step.
        Positions p < j - 1 of step j have no such draft: their outputs are meaningless. The outputs fed on are
        detached: step j's loss trains the head to read its own features without pulling step j - 1's away from the
        target's (undetached, a SmolLM2-135M head's first-draft top-1 fell from 0.235 to 0.082, held out)."""
        layer, config = self.layers[0], self.config
        attn = layer.self_attn
        if layer.pre_feedforward_layernorm is not None or not hasattr(layer.mlp, "gate_up_proj"):
            raise ValueError("training EAGLE heads supports Llama-shaped layers (one norm before a dense MLP)")
        if attn.q_norm is not None and attn.q_norm.weight.shape[0] != config.head_dim:
            raise ValueError("training EAGLE heads needs per-head q/k norms or none")
        b, t, _ = embeds.shape
        rotations = self.rotary.rotations(torch.arange(t)).repeat(b, 1, 1, 1)
        keys, values, outputs = [], [], []
        for step in range(steps):
            if step:
                features = F.pad(outputs[-1][:, :-1].detach(), (0, 0, 1, 0))
            x = self.fc(torch.cat([embeds, features], dim=-1))
            qkv = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias).view(b, t, -1, config.head_dim)
            q, k, v = qkv.split([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=2)
            if attn.q_norm is not None:
                q, k = (_rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm))
            q, k = (apply_rotary(z.flatten(0, 1), rotations).view(z.shape).transpose(1, 2) for z in (q, k))
            keys.append(k)
            values.append(v.transpose(1, 2))
            out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                                 attn_mask=_unrolled_mask(t, step, x.device), scale=attn.attn.scale,
                                                 enable_gqa=attn.num_heads != attn.num_kv_heads)
            x = x + F.linear(out.transpose(1, 2).flatten(2), attn.o_proj.weight, attn.o_proj.bias)
            mlp = layer.mlp
            gate, up = F.linear(_rms_norm(x, layer.post_attention_layernorm), mlp.gate_up_proj.weight).chunk(2, dim=-1)
            outputs.append(x + F.linear(mlp.act(gate) * up, mlp.down_proj.weight))
        return outputs


def _unrolled_mask(t: int, step: int, device: torch.device) -> torch.Tensor:
    """[T, (step + 1) T]: what a query at position p of unrolled step `step` (0-based) may see of the keys of steps
    0..step: step 0's at positions <= p - step, step i's (i >= 1) at p - step + i alone."""
    ones = torch.ones(t, t, dtype=torch.bool, device=device)
    return torch.cat([ones.tril(-step)] + [ones.tril(i - step).triu(i - step) for i in range(1, step + 1)], dim=1)


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
