"""The request for a LoRA adapter, with vLLM's names: which adapter a request runs with."""
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: the adapter's name (the served model name on the server). `lora_int_id`: its id, >= 1, unique
    per engine (0 means no adapter). `lora_path`: a PEFT adapter folder (adapter_config.json and
    adapter_model.safetensors / .bin) or a llama.cpp GGUF LoRA file. `base_model_name`: the base model the adapter
    was trained on, if known (informational)."""
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name must be a string or None, got {self.base_model_name!r}")
