"""The decoder of every supported architecture, over a flat batch of tokens and a paged KV cache: the Llama shape
(llama, mistral, qwen2) with optional pieces switched on by the config — per-head q/k norms (qwen3, gemma3),
sliding-window layers, Gemma's sandwich norms, GeGLU, scaled embeddings and soft-capping, and mixture-of-experts
feed-forward blocks (inferno/layers/moe.py)."""
import torch
from torch import nn

from inferno.config import ModelConfig
from inferno.distributed.parallel_state import SINGLE, ParallelRank
from inferno.layers.attention import Attention
from inferno.layers.fused_cpu import cpu_fused_ops
from inferno.layers.lora import LoRAMapping, LoRAStack, add_lora
from inferno.layers.mlp import MLP
from inferno.layers.moe import SparseMoE
from inferno.layers.norm import RMSNorm
from inferno.layers.parallel_linear import QKVParallelLinear, RowParallelLinear
from inferno.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from inferno.layers.rotary import RotaryEmbedding, apply_rotary


class SelfAttention(nn.Module):
    """This rank's attention heads (all of them with one rank)."""

    def __init__(self, config: ModelConfig, layer: int, parallel: ParallelRank):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias, parallel)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, self.qkv_proj.shards[0],
                                        config.hidden_size, parallel)
        self.q_norm = self.k_norm = None
        if config.qk_norm == "full" and parallel.tp_size > 1:
            raise ValueError(f"{config.architecture}: q/k norms over all heads are not split across tensor-parallel "
                             "ranks yet; use pipeline_parallel_size instead")
        if config.qk_norm is not None:
            q_size, k_size = ((self.head_dim, self.head_dim) if config.qk_norm == "head"
                              else (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim))
            self.q_norm = RMSNorm(q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(k_size, config.rms_norm_eps)
        scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        window = config.sliding_window if config.is_sliding(layer) else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, window,
                              config.attn_logit_softcapping)
        self.qkv_lora: LoRAStack | None = None  # set when the engine serves LoRA adapters (model/lora.py)
        self.o_lora: LoRAStack | None = None

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, meta, lora: LoRAMapping | None = None) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:  # checked here: a call per projection would cost every base step too
            qkv = add_lora(qkv, x, self.qkv_lora, lora)
        if self.q_norm is not None and self.q_norm.weight.shape[0] != self.head_dim:  # norms over all heads
            q, k, v = qkv.split([self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2], dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        qkv = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k = self.rotated_qk(qkv[:, :self.num_heads + self.num_kv_heads], rotations)
        attended = self.attn(q, k, qkv[:, self.num_heads + self.num_kv_heads:], meta)
        out = self.o_proj(attended)
        return out if lora is None else add_lora(out, attended, self.o_lora, lora)

    def rotated_qk(self, qk: torch.Tensor, rotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [T, heads + kv_heads, D], a view of the projection's output -> q and k, normed per head (qwen3,
        gemma3) and rotated."""
        if self.q_norm is not None and self.q_norm.weight.shape[0] == self.head_dim:  # per-head norms
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if qk.is_cuda:  # in place, one Triton kernel each
            from inferno.kernels.triton_fused import rotary_
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            return rotary_(q, rotations), rotary_(k, rotations)
        ops = cpu_fused_ops(qk)
        if ops is not None and rotations.is_contiguous() and rotations.dtype == torch.float32:  # native, one call
            rotated = ops.rotary(qk, rotations)
        else:
            rotated = apply_rotary(qk, rotations)
        return rotated.split([self.num_heads, self.num_kv_heads], dim=1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, parallel: ParallelRank):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.moe
        self.mlp = (SparseMoE(config, parallel) if moe is not None and layer not in moe.dense_layers
                    else MLP(config.hidden_size, config.intermediate_size, config.hidden_act, parallel))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotations: torch.Tensor, meta,
                lora: LoRAMapping | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream `residual` (None: x is the stream)
        -> (this layer's output, the stream it is to be added to). Each add runs in the norm after it (one kernel);
        the model adds the last layer's output itself."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn = self.self_attn(h, rotations, meta, lora)
        mlp = self.mlp if lora is None else lambda h: self.mlp(h, lora)  # adapters: dense MLPs only (model/lora.py)
        if self.pre_feedforward_layernorm is None:  # post_attention_layernorm is the feed-forward's input norm
            h, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
            return mlp(h), residual
        # Gemma: norms on both sides of the attention and of the feed-forward block
        residual = residual + self.post_attention_layernorm(attn)
        return self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(residual))), residual


class LlamaForCausalLM(nn.Module):
    """One rank's part of the model: its pipeline stage's layers (other stages' are `nn.Identity` placeholders that
    keep checkpoint names lined up); on the first stage also the embedding, final norm and LM head."""

    def __init__(self, config: ModelConfig, parallel: ParallelRank = SINGLE):
        super().__init__()
        self.config = config
        self.stage_layers = parallel.stage_layers(config.num_hidden_layers)
        self.holds_head = parallel.is_first_stage
        self.layers = nn.ModuleList(DecoderLayer(config, i, parallel) if i in self.stage_layers else nn.Identity()
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
        # Gemma 3: the sliding layers' own rope base, unscaled
        self.local_rotary = None if config.rope_local_theta is None else RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_local_theta)

    @property
    def attention_layers(self) -> list[Attention]:
        return [self.layers[i].self_attn.attn for i in self.stage_layers]

    def to_device(self, device: torch.device) -> "LlamaForCausalLM":
        """Parameters and the rotary tables on `device`."""
        self.to(device)
        for rotary in (self.rotary, self.local_rotary):
            if rotary is not None:
                rotary.cos_sin_cache = rotary.cos_sin_cache.to(device)
        return self

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (without the `model.` prefix) belongs to this pipeline stage."""
        if name.startswith("layers."):
            return int(name.split(".", 2)[1]) in self.stage_layers
        return self.holds_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                hidden: torch.Tensor | None = None, lora: LoRAMapping | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] (before the final norm) for a flat batch of tokens, through this stage's layers;
        `hidden`: the previous stage's output (later stages), instead of embedding `input_ids`; `lora`: each token's
        adapter slot, when the step runs LoRA adapters."""
        x = hidden
        if x is None:
            x = self.embed_tokens(input_ids)
            if self.config.embedding_multiplier != 1.0:  # Gemma: x sqrt(hidden), rounded to the model dtype
                x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)
        rotations = self.rotary.rotations(positions)
        local = rotations if self.local_rotary is None else self.local_rotary.rotations(positions)
        residual = None
        for i in self.stage_layers:
            x, residual = self.layers[i](x, residual, local if self.config.is_sliding(i) else rotations, meta, lora)
        return x if residual is None else x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits on tensor rank 0 of the first stage; None on the other tensor ranks."""
        logits = self.lm_head(self.norm(hidden))
        if logits is None:
            return None
        cap = self.config.final_logit_softcapping
        if logits.dtype != torch.float32:
            logits = logits.float()
        return logits if cap is None else torch.tanh(logits / cap) * cap
