"""llama.cpp's GGUF LoRA files (the layout convert_lora_to_gguf.py writes) read into the adapter form every adapter
file becomes: PEFT's adapter_config.json keys and PEFT's tensor names, A [r, in] and B [out, r] in Hugging Face's row
order, float32.

A file has `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha` (0: a scale of 1) and, per adapted
weight `blk.N.attn_q.weight`, the pair `blk.N.attn_q.weight.lora_a` / `.lora_b`. llama.cpp scales each pair by
alpha / its own rank, as PEFT does with `rank_pattern`. The converter applied the base model's conversion to the
pair as if it were the weight: for `llama` files that is the interleaved rotary order of q and k rows, which lands on
B's rows and is undone here with the base model's head counts (the file does not hold them).
"""
from collections import Counter

import torch

from inferno.config import ModelConfig
from inferno.loader.gguf import float_weight, hf_name, unpermute_rotary
from inferno.loader.gguf_architectures import EXPERT_TENSORS
from inferno.loader.gguf_file import GGUFFile, GGUFTensor

PEFT_PREFIX = "base_model.model."
HF_HUB = "https://huggingface.co/"


def read_gguf_adapter(path: str, model_config: ModelConfig | None = None
                      ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(PEFT adapter config, PEFT-named float32 tensors) of the GGUF LoRA file at `path`. `model_config`, the base
    model's, is needed for `llama` files that adapt q or k (their B rows are in llama.cpp's rotary order).
    Raises ValueError for a file that is not a GGUF LoRA or holds something other than LoRA pairs."""
    gguf_file = GGUFFile(path)
    check_adapter_type(gguf_file)
    arch = gguf_file.field("general.architecture")
    pairs = lora_pairs(gguf_file, arch)
    tensors, ranks = {}, {}
    for module, (lora_a, lora_b) in pairs.items():
        a, b = float_weight(lora_a), float_weight(lora_b)
        ranks[module] = pair_rank(module, lora_a.name, a, b)
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):
            b = unpermute_rotary(b, rotary_heads(module, b.shape[0], model_config, path))
        tensors.update(peft_tensors(module, a, b))
    return adapter_config(gguf_file, ranks), tensors


def check_adapter_type(gguf_file: GGUFFile) -> None:
    kind, adapter = gguf_file.field("general.type"), gguf_file.field("adapter.type")
    if kind != "adapter":
        raise ValueError(f"{gguf_file.path} is not a GGUF adapter (general.type is {kind!r}, not 'adapter'): "
                         "a model file is passed as the model, not as a LoRA")
    if adapter != "lora":
        raise ValueError(f"{gguf_file.path} is a GGUF adapter of type {adapter!r}; only 'lora' adapters are supported")
    if gguf_file.field("adapter.alora.invocation_tokens") is not None:
        raise ValueError(f"{gguf_file.path} is an activated LoRA (aLoRA), which is not supported")


def lora_pairs(gguf_file: GGUFFile, arch: str) -> dict[str, tuple[GGUFTensor, GGUFTensor]]:
    """HF module name (`model.layers.0.self_attn.q_proj`) -> its (lora_a, lora_b) tensors."""
    halves: dict[str, dict[str, GGUFTensor]] = {}
    for tensor in gguf_file.tensors:
        base, _, half = tensor.name.rpartition(".")
        if half not in ("lora_a", "lora_b"):
            raise ValueError(f"{gguf_file.path} holds tensor {tensor.name!r}, which is not a LoRA pair's half "
                             "(full tensors in an adapter, such as mergekit's norms, are not supported)")
        if base.split(".", 2)[-1] in EXPERT_TENSORS:
            raise ValueError(f"{gguf_file.path} adapts the routed experts ({base!r}), which is not supported")
        name = module_weight_name(base, arch)
        if name is None or not name.endswith(".weight"):
            raise ValueError(f"{gguf_file.path} adapts {base!r}, which {arch!r} models do not have")
        halves.setdefault(name.removesuffix(".weight"), {})[half] = tensor
    if not halves:
        raise ValueError(f"{gguf_file.path} holds no LoRA tensors")
    for module, pair in halves.items():
        if len(pair) != 2:
            missing = "lora_b" if "lora_a" in pair else "lora_a"
            raise ValueError(f"{gguf_file.path} lacks the {missing} half of {module!r}'s LoRA pair")
    return {module: (pair["lora_a"], pair["lora_b"]) for module, pair in halves.items()}


def module_weight_name(gguf_name: str, arch: str) -> str | None:
    try:
        return hf_name(gguf_name, arch)
    except ValueError:  # not "blk.N.name" nor a global tensor's name
        return None


def pair_rank(module: str, name: str, a: torch.Tensor, b: torch.Tensor) -> int:
    # token_embd's A is stored transposed ([vocab, r]), as llama.cpp looks rows of it up
    rank = a.shape[-1] if module.endswith("embed_tokens") else a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
        raise ValueError(f"LoRA pair {name.removesuffix('.lora_a')!r} has shapes {tuple(a.shape)} (lora_a) and "
                         f"{tuple(b.shape)} (lora_b), which do not share a rank")
    return rank


def rotary_heads(module: str, rows: int, model_config: ModelConfig | None, path: str) -> int:
    if model_config is None:
        raise ValueError(f"{path} is a `llama` GGUF LoRA adapting q/k: reading it needs the base model's config "
                         "(its head counts undo llama.cpp's rotary row order)")
    heads = model_config.num_attention_heads if module.endswith("q_proj") else model_config.num_key_value_heads
    if rows % (2 * heads):
        raise ValueError(f"{path}: {module}'s LoRA has {rows} output rows, which {heads} heads of the base model do "
                         "not divide (an adapter of another base model?)")
    return heads


def peft_tensors(module: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    if module.endswith("embed_tokens"):  # PEFT's embedding LoRA: A [r, vocab], B [hidden, r]
        return {f"{PEFT_PREFIX}{module}.lora_embedding_A": a.T.contiguous(),
                f"{PEFT_PREFIX}{module}.lora_embedding_B": b}
    return {f"{PEFT_PREFIX}{module}.lora_A.weight": a, f"{PEFT_PREFIX}{module}.lora_B.weight": b}


def adapter_config(gguf_file: GGUFFile, ranks: dict[str, int]) -> dict:
    """PEFT's config keys for llama.cpp's scaling: each pair by alpha / its rank (alpha 0: by 1, i.e. alpha = rank).
    The most common rank is `r`; the others go to `rank_pattern` (and `alpha_pattern` when alpha follows the rank)."""
    alpha = float(gguf_file.field("adapter.lora.alpha", 0.0))
    r = Counter(ranks.values()).most_common(1)[0][0]
    others = {module: rank for module, rank in ranks.items() if rank != r}
    return {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha or float(r),
        "rank_pattern": others,
        "alpha_pattern": {} if alpha else {module: float(rank) for module, rank in others.items()},
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module in ranks}),
        "use_rslora": False,
        "modules_to_save": None,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": base_model_name(gguf_file),
    }


def base_model_name(gguf_file: GGUFFile) -> str | None:
    """The Hugging Face id of the base model the converter found in the adapter's model card, if any."""
    url = gguf_file.field("general.base_model.0.repo_url")
    if isinstance(url, str) and url.startswith(HF_HUB):
        return url.removeprefix(HF_HUB)
    return gguf_file.field("general.base_model.0.name")
