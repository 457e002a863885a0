"""Llama-family decoder (llama, mistral, qwen2) over a flat batch of tokens and a paged KV cache."""
import torch
import torch.nn.functional as F
from torch import nn

from inferno.config import ModelConfig
from inferno.distributed.parallel_state import SINGLE, ParallelRank
from inferno.layers.attention import Attention, AttentionMetadata
from inferno.layers.parallel_linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from inferno.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from inferno.layers.rotary import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # normalise in float32 like the reference implementation, then scale in the model dtype
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class SelfAttention(nn.Module):
    """This rank's attention heads (all of them with one rank)."""

    def __init__(self, config: ModelConfig, parallel: ParallelRank):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias, parallel)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, self.qkv_proj.shards[0],
                                        config.hidden_size, parallel)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = apply_rotary(qkv[:, :self.num_heads + self.num_kv_heads], rotations)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        return self.o_proj(self.attn(q, k, v, meta))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelRank):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, config.intermediate_size, parallel)
        self.down_proj = RowParallelLinear(config.intermediate_size, self.gate_up_proj.shards[0],
                                           config.hidden_size, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelRank):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, parallel)

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotations, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """One rank's part of the model: its pipeline stage's layers (other stages' are `nn.Identity` placeholders that
    keep checkpoint names lined up); on the first stage also the embedding, final norm and LM head."""

    def __init__(self, config: ModelConfig, parallel: ParallelRank = SINGLE):
        super().__init__()
        self.config = config
        self.stage_layers = parallel.stage_layers(config.num_hidden_layers)
        self.holds_head = parallel.is_first_stage
        self.layers = nn.ModuleList(DecoderLayer(config, parallel) if i in self.stage_layers else nn.Identity()
                                    for i in range(config.num_hidden_layers))
        self.embed_tokens = self.norm = self.lm_head = None
        if self.holds_head:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)

    @property
    def attention_layers(self) -> list[Attention]:
        return [self.layers[i].self_attn.attn for i in self.stage_layers]

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (without the `model.` prefix) belongs to this pipeline stage."""
        if name.startswith("layers."):
            return int(name.split(".", 2)[1]) in self.stage_layers
        return self.holds_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] (before the final norm) for a flat batch of tokens, through this stage's layers;
        `hidden`: the previous stage's output (later stages), instead of embedding `input_ids`."""
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        rotations = self.rotary.rotations(positions)
        for i in self.stage_layers:
            x = self.layers[i](x, rotations, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits on tensor rank 0 of the first stage; None on the other tensor ranks."""
        logits = self.lm_head(self.norm(hidden))
        return None if logits is None else logits.float()
