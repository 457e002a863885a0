"""The model names the server answers to (vLLM's OpenAIServingModels): the base model's served name and one per
LoRA adapter (`--lora-modules`, `/v1/load_lora_adapter`), each resolved to the adapter a request runs with; the
server gives adapters their `lora_int_id`s. /v1/models lists them, adapters with their `parent`."""
import asyncio
import itertools
import os
from pathlib import Path

from inferno.engine.async_llm import AsyncLLM, EngineDeadError
from inferno.lora_request import LoRARequest
from inferno.server.cli_args import LoRAModulePath
from inferno.server.protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest
from inferno.server.serving import OpenAIError

RUNTIME_LORA_UPDATING_FLAGS = ("INFERNO_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_updating_allowed() -> bool:
    """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served (either environment flag "1"/"true")."""
    return any(os.environ.get(flag, "").strip().lower() in ("1", "true") for flag in RUNTIME_LORA_UPDATING_FLAGS)


def model_not_found(model: str, served: list[str]) -> OpenAIError:
    return OpenAIError(f"The model `{model}` does not exist; this server serves {', '.join(f'`{m}`' for m in served)}.",
                       status_code=404, param="model", code="model_not_found")


class ServingModels:
    def __init__(self, async_llm: AsyncLLM, base_model_name: str):
        self.async_llm = async_llm
        self.base_model_name = base_model_name
        self.lora_requests: dict[str, LoRARequest] = {}  # served name -> adapter
        self._lora_ids = itertools.count(1)
        self._updating = asyncio.Lock()  # one load or unload at a time: a name is checked and taken atomically

    # requests
    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no name). 404 for an unknown name."""
        if model is None or model == self.base_model_name:
            return None
        lora_request = self.lora_requests.get(model)
        if lora_request is None:
            raise model_not_found(model, [self.base_model_name, *self.lora_requests])
        return lora_request

    def model_name(self, lora_request: LoRARequest | None) -> str:
        """The name a response reports: the adapter's, or the base model's."""
        return self.base_model_name if lora_request is None else lora_request.lora_name

    def model_cards(self) -> list[ModelCard]:
        engine = self.async_llm.engine
        base = ModelCard(id=self.base_model_name, root=engine.model_path, max_model_len=engine.max_model_len)
        adapters = [ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name or self.base_model_name,
                              max_model_len=engine.max_model_len) for name, lora in self.lora_requests.items()]
        return [base, *adapters]

    # adapters
    def add_static_loras(self, modules: list[LoRAModulePath]) -> None:
        """`--lora-modules`, added before the engine thread starts (ValueError if one cannot be)."""
        for module in modules:
            try:
                lora_request = self.new_lora_request(module.name, module.path, module.base_model_name)
            except OpenAIError as e:
                raise ValueError(f"--lora-modules {module.name}: {e}") from None
            self.async_llm.engine.add_lora(lora_request)
            self.lora_requests[module.name] = lora_request

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        async with self._updating:
            lora_request = self.new_lora_request(request.lora_name, request.lora_path)
            try:
                await self.async_llm.add_lora(lora_request)
            except ValueError as e:  # the adapter does not fit the model, or LoRA is not enabled
                raise OpenAIError(str(e)) from e
            except EngineDeadError as e:
                raise OpenAIError(str(e), status_code=503, type="server_error") from e
            self.lora_requests[request.lora_name] = lora_request
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        async with self._updating:
            lora_request = self.lora_requests.get(request.lora_name)
            if lora_request is None or request.lora_int_id not in (None, lora_request.lora_int_id):
                raise OpenAIError(f"The LoRA adapter '{request.lora_name}' cannot be found.", status_code=404,
                                  param="lora_name", code="lora_not_found")
            del self.lora_requests[request.lora_name]  # new requests stop naming it; running ones finish with it
            try:
                await self.async_llm.remove_lora(lora_request.lora_int_id)
            except EngineDeadError as e:
                raise OpenAIError(str(e), status_code=503, type="server_error") from e
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    def new_lora_request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """An adapter under a new name with the next id; 400 for a name taken or a path that does not exist."""
        if not name:
            raise OpenAIError("lora_name must not be empty", param="lora_name")
        if name == self.base_model_name:
            raise OpenAIError(f"lora_name '{name}' is the base model's served name; choose another",
                              param="lora_name")
        if name in self.lora_requests:
            raise OpenAIError(f"The LoRA adapter '{name}' has already been loaded; unload it first to replace it.",
                              param="lora_name")
        if not path or not Path(path).exists():
            raise OpenAIError(f"LoRA path '{path}' does not exist (a PEFT adapter folder or a GGUF LoRA file on the "
                              "server)", param="lora_path")
        return LoRARequest(name, next(self._lora_ids), path, base_model_name)
