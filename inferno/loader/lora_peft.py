"""PEFT's LoRA adapter folder (adapter_config.json + adapter_model.safetensors or .bin) -> (config, tensors)."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def read_peft_adapter(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The adapter's config (adapter_config.json's keys) and its tensors under PEFT's names
    (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r])."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {path!r} has no adapter_config.json (expected a PEFT adapter folder or a "
                         "GGUF LoRA file)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json must hold an object")
    safetensors, pickled = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if not safetensors.is_file() and not pickled.is_file():
        raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors or adapter_model.bin")
    try:
        if safetensors.is_file():
            tensors = load_file(safetensors)
        else:
            tensors = torch.load(pickled, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"LoRA adapter {path!r}: its weights could not be read ({type(e).__name__}: {e})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError(f"LoRA adapter {path!r}: adapter_model.bin does not hold a dict of tensors")
    return config, tensors
