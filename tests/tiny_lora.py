"""LoRA adapters of the tiny models: written by peft (the oracle) with B not zero, and converted to llama.cpp's GGUF
LoRA layout with `gguf.GGUFWriter` the way convert_lora_to_gguf.py lays it out (pairs under the base weight's GGUF
name + `.lora_a` / `.lora_b`, the base's conversion applied to B's rows: llama's rotary order of q and k)."""
import copy
import json
from pathlib import Path

import gguf
import numpy as np
import peft
import torch
from safetensors.torch import load_file

from tiny_models import gguf_name, llama_cpp_rotary_order

PEFT_PREFIX = "base_model.model."


def write_peft_adapter(folder: Path, hf_model: torch.nn.Module, rank: int, target_modules: list[str], seed: int,
                       lora_alpha: float | None = None, **options) -> peft.PeftModel:
    """A random adapter of `hf_model` (which is left untouched) saved in `folder`; returns the PEFT model, in eval
    mode. `init_lora_weights=False` keeps torch's default init of B (not zero), so the adapter changes the outputs."""
    config = peft.LoraConfig(r=rank, lora_alpha=lora_alpha or 2 * rank, target_modules=target_modules,
                             init_lora_weights=False, **options)
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    model.save_pretrained(folder)
    return model.eval()


def peft_adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "adapter_model.safetensors"))


def write_gguf_lora(path: Path, adapter_folder: Path, hf_config, arch: str,
                    dtype: np.dtype = np.float32, lora_alpha: float | None = None) -> Path:
    """The PEFT adapter in `adapter_folder` as a llama.cpp GGUF LoRA file of architecture `arch` (`lora_alpha`:
    another alpha written than the adapter's)."""
    alpha = json.loads((adapter_folder / "adapter_config.json").read_text())["lora_alpha"]
    alpha = alpha if lora_alpha is None else lora_alpha
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for name, (a, b) in lora_pairs(peft_adapter_tensors(adapter_folder)).items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf_config.num_attention_heads if "q_proj" in name else hf_config.num_key_value_heads
            b = llama_cpp_rotary_order(b, heads)
        writer.add_tensor(f"{gguf_name(name, arch)}.lora_a", a.float().numpy().astype(dtype))
        writer.add_tensor(f"{gguf_name(name, arch)}.lora_b", b.float().numpy().astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def lora_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF weight name (`model.layers.0.self_attn.q_proj.weight`) -> (A, B) of a PEFT state dict."""
    modules = {key.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for key in tensors}
    return {f"{m}.weight": (tensors[f"{PEFT_PREFIX}{m}.lora_A.weight"], tensors[f"{PEFT_PREFIX}{m}.lora_B.weight"])
            for m in sorted(modules)}
