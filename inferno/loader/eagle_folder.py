"""The folder of an EAGLE-1/2 head, in the layout vLLM (`EagleLlamaForCausalLM`) and SGLang (`LlamaForCausalLMEagle`)
load, which is the reference EAGLE repository's: a config.json of the head's one decoder layer (`hidden_size`,
`intermediate_size`, heads, `vocab_size`, ...) and its weights in `model.safetensors` or `pytorch_model.bin`
(or sharded `*.safetensors`), named without the `model.` prefix (some folders have it; both load): `fc.weight`
[hidden, 2 * hidden], `fc.bias` when the fc has one, `layers.0.self_attn.{q,k,v,o}_proj.*`,
`layers.0.post_attention_layernorm.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`, and optionally
`embed_tokens.weight` (unused: the target's embedding is shared, as vLLM and SGLang do on one process) and
`lm_head.weight` (the head's own LM head; without it the target's). The own LM head may cover a draft vocabulary
(EAGLE-3's, in vLLM's and SGLang's layout): `draft_vocab_size` rows in config.json, and `d2t` [draft_vocab_size],
draft id i being target id i + d2t[i] (`t2d`, the target-side mask, is not needed)."""
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from inferno.config import ModelConfig
from inferno.loader.head_folder import read_head_config, read_head_weights

# the reference repository's folders name the target's architecture; the engines' names say EAGLE
EAGLE_ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "EagleQwen2ForCausalLM",
                       "Qwen2ForCausalLMEagle", "EAGLEModel", "LlamaForCausalLM", "Qwen2ForCausalLM",
                       "MistralForCausalLM")
EAGLE3_ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3Speculator")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
VLLM_ARCHITECTURE = "EagleLlamaForCausalLM"


@dataclass(slots=True)
class EagleFolder:
    config: dict  # config.json
    tensors: dict[str, torch.Tensor]  # without the `model.` prefix; embed_tokens dropped

    @property
    def fc_bias(self) -> bool:
        return "fc.bias" in self.tensors

    @property
    def own_lm_head(self) -> bool:
        return "lm_head.weight" in self.tensors

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """The target ids of a draft vocabulary's tokens (from `d2t`), or None."""
        d2t = self.tensors.get("d2t")
        return None if d2t is None else torch.arange(len(d2t)) + d2t.long()


def read_eagle_folder(folder: str | Path) -> EagleFolder:
    folder = Path(folder)
    config = read_head_config(folder, "an EAGLE head")
    architectures = config.get("architectures") or []
    if any(a in EAGLE3_ARCHITECTURES for a in architectures):
        raise ValueError(f"{folder} holds an EAGLE-3 head ({architectures[0]}); method 'eagle' runs EAGLE-1/2 heads "
                         f"(EAGLE-3 is not supported yet)")
    if architectures and not any(a in EAGLE_ARCHITECTURES for a in architectures):
        raise ValueError(f"{folder} is not an EAGLE head: its architectures are {architectures}, expected one of "
                         f"{list(EAGLE_ARCHITECTURES[:4])}")
    stored = read_head_weights(folder, WEIGHT_FILES, "an EAGLE head", sharded=True)
    tensors = {name.removeprefix("model."): t for name, t in stored.items()
               if not name.removeprefix("model.").startswith("embed_tokens.")}
    if "fc.weight" not in tensors:
        raise ValueError(f"{folder} is not an EAGLE-1/2 head: its weights have no fc.weight (the [hidden, 2 * hidden] "
                         f"projection of the token embedding and the target's feature)")
    layers = sorted({int(m.group(1)) for name in tensors if (m := re.match(r"layers\.(\d+)\.", name))})
    if layers != [0]:
        raise ValueError(f"{folder}: an EAGLE head here has one decoder layer (layers.0), its weights have layers "
                         f"{layers}")
    tensors.pop("t2d", None)
    unknown = sorted(n for n in tensors if not re.match(r"(fc\.(weight|bias)|lm_head\.weight|d2t$|layers\.0\.)", n))
    if unknown:
        raise ValueError(f"{folder}: EAGLE head tensors {unknown[:5]} have no place in the head")
    tensors.pop("layers.0.input_layernorm.weight", None)  # the head's layer has no input norm
    return EagleFolder(config, tensors)


def eagle_head_config(folder: EagleFolder, target: ModelConfig) -> ModelConfig:
    """The head's layer's shape: the target's architecture with the folder's sizes, checked against the target
    (the head reads the target's features and feeds its embedding and LM head)."""
    config, tensors = folder.config, folder.tensors
    hidden = config.get("hidden_size", target.hidden_size)
    fc_shape = tuple(tensors["fc.weight"].shape)
    if hidden != target.hidden_size or fc_shape != (target.hidden_size, 2 * target.hidden_size):
        raise ValueError(f"the EAGLE head has hidden size {hidden} (fc {fc_shape}) but the target's is "
                         f"{target.hidden_size}: the head was trained for another model")
    vocab = config.get("vocab_size", target.vocab_size)
    if vocab != target.vocab_size:
        raise ValueError(f"the EAGLE head has a vocabulary of {vocab} tokens but the target has "
                         f"{target.vocab_size}: the head was trained for another model")
    check_draft_vocabulary(folder, target.vocab_size)
    heads = config.get("num_attention_heads", target.num_attention_heads)
    return dataclasses.replace(
        head_layer_config(target),
        intermediate_size=config.get("intermediate_size", target.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        rms_norm_eps=config.get("rms_norm_eps", target.rms_norm_eps),
        rope_theta=config.get("rope_theta", target.rope_theta),
        hidden_act=config.get("hidden_act", target.hidden_act),
        attention_bias="layers.0.self_attn.q_proj.bias" in tensors,
        qk_norm="head" if "layers.0.self_attn.q_norm.weight" in tensors else None)


def check_draft_vocabulary(folder: EagleFolder, vocab_size: int) -> None:
    """The own LM head has a row per token of the draft vocabulary (the target's whole vocabulary without `d2t`),
    and `d2t` maps them to distinct target tokens."""
    lm_head, draft_to_target = folder.tensors.get("lm_head.weight"), folder.draft_to_target
    if draft_to_target is None:
        if lm_head is not None and lm_head.shape[0] != vocab_size:
            raise ValueError(f"the EAGLE head's LM head has {lm_head.shape[0]} rows but the target's vocabulary "
                             f"{vocab_size} tokens (a draft vocabulary needs its d2t)")
        return
    size = folder.config.get("draft_vocab_size", len(draft_to_target))
    if lm_head is None or lm_head.shape[0] != size or len(draft_to_target) != size:
        raise ValueError(f"the EAGLE head's draft vocabulary of {size} tokens needs an LM head and a d2t of as many "
                         f"rows, got {None if lm_head is None else lm_head.shape[0]} and {len(draft_to_target)}")
    if (draft_to_target.min() < 0 or draft_to_target.max() >= vocab_size
            or len(draft_to_target.unique()) != size):
        raise ValueError(f"the EAGLE head's d2t maps its draft vocabulary outside the target's {vocab_size} tokens "
                         f"or onto one token twice")


def head_layer_config(target: ModelConfig) -> ModelConfig:
    """One layer of the target's architecture, every layer's kind (no sliding window, a dense MLP)."""
    return dataclasses.replace(target, num_hidden_layers=1, sliding_window=None, sliding_layers=None, moe=None,
                               tie_word_embeddings=False)


def eagle_config_json(config: ModelConfig, fc_bias: bool, base_model: str | None,
                      draft_vocab_size: int | None = None) -> dict:
    """config.json of a head whose layer has `config`'s shape, as vLLM reads it (with its draft vocabulary's
    size, if it has one)."""
    draft = {} if draft_vocab_size is None else {"draft_vocab_size": draft_vocab_size}
    return {**draft, "architectures": [VLLM_ARCHITECTURE], "model_type": "llama", "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
            "max_position_embeddings": config.max_position_embeddings, "vocab_size": config.vocab_size,
            "hidden_act": config.hidden_act, "tie_word_embeddings": False, "bias": fc_bias,
            "base_model_name_or_path": base_model, "torch_dtype": "float32"}


def write_eagle_folder(folder: str | Path, head: EagleFolder) -> Path:
    """vLLM's layout: config.json and model.safetensors, tensors under their HF names."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.detach().contiguous().cpu() for name, t in head.tensors.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(head.config, indent=2) + "\n")
    return folder
