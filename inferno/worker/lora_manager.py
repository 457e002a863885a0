"""The worker's LoRA adapters: read and checked when added, kept on the CPU (LRU, `max_cpu_loras`), and copied into
one of the model's `max_loras` stack slots when a step runs them. A slot whose adapter runs in the step is never
reused within it (the scheduler admits at most `max_loras` adapters per step, so a free one always exists)."""
import logging
from collections import OrderedDict

import torch

from inferno.config import EngineConfig
from inferno.layers.lora import LoRAMapping
from inferno.loader.lora_adapter import LoRAAdapter, load_lora_adapter
from inferno.lora_request import LoRARequest
from inferno.model.llama import LlamaForCausalLM
from inferno.model.lora import attach_lora_stacks

logger = logging.getLogger("inferno")


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, device: torch.device):
        self.model_config = model.config
        self.max_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.dtype, self.device = config.torch_dtype, device
        self.stacks = attach_lora_stacks(model, config.max_loras + 1, self.max_rank, self.dtype, device)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # on the CPU, least recently used first
        # slot -> adapter id (0: empty); slot 0 is "no adapter". `slot_order`: slots 1.., least recently used first
        self.slot_ids = [0] * (config.max_loras + 1)
        self.slot_order = list(range(1, config.max_loras + 1))

    def add(self, request: LoRARequest) -> bool:
        """Read and check the adapter (ValueError if it does not fit the model); False if it was held already."""
        if request.lora_int_id in self.adapters:
            self.adapters.move_to_end(request.lora_int_id)
            return False
        self._keep(load_lora_adapter(request, self.model_config, self.max_rank, self.dtype))
        self._forget_slot(request.lora_int_id)  # a slot may still hold an adapter removed under the same id
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Drop the CPU copy; the slot stays until reused (a request still running with it reloads nothing)."""
        return self.adapters.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.adapters)

    def mapping(self, token_lora_ids: list[int], requests: dict[int, LoRARequest]) -> LoRAMapping | None:
        """The step's mapping of token rows to slots, the step's adapters put into slots first; None when no
        token runs an adapter (the product is skipped). `requests`: the step's adapters by id (reloaded from their
        path if the CPU copy was evicted or removed)."""
        wanted = set(token_lora_ids) - {0}
        if not wanted:
            return None
        slot_of = {self.slot_ids[s]: s for s in range(1, len(self.slot_ids)) if self.slot_ids[s]}
        for lora_int_id in wanted:
            if lora_int_id not in slot_of:
                slot_of[lora_int_id] = self._load_into_slot(requests[lora_int_id], wanted)
            self.slot_order.remove(slot_of[lora_int_id])
            self.slot_order.append(slot_of[lora_int_id])
        return LoRAMapping.of([slot_of[i] if i else 0 for i in token_lora_ids], self.device)

    def _load_into_slot(self, request: LoRARequest, wanted: set[int]) -> int:
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is None:
            adapter = load_lora_adapter(request, self.model_config, self.max_rank, self.dtype)
            self._keep(adapter)
        slot = next(s for s in self.slot_order if self.slot_ids[s] not in wanted)  # the least recently used
        for (layer, attr), stack in self.stacks.items():
            stack.set_slot(slot, adapter.weights.get((layer, attr), [None] * len(stack.slice_sizes)))
        self.slot_ids[slot] = adapter.lora_int_id
        return slot

    def _keep(self, adapter: LoRAAdapter) -> None:
        self.adapters[adapter.lora_int_id] = adapter
        while len(self.adapters) > self.max_cpu_loras:
            evicted, _ = self.adapters.popitem(last=False)
            logger.info("LoRA adapter %d evicted from the CPU cache (max_cpu_loras=%d); it is read again from its "
                        "path when a request runs it", evicted, self.max_cpu_loras)

    def _forget_slot(self, lora_int_id: int) -> None:
        for slot, held in enumerate(self.slot_ids):
            if held == lora_int_id:
                self.slot_ids[slot] = 0
