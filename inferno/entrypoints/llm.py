"""The offline API: LLM(model=...).generate(prompts, sampling_params), shaped like vLLM's."""
import itertools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from inferno.config import EngineConfig
from inferno.entrypoints.calibration_text import CALIBRATION_TEXTS
from inferno.engine.input_processor import ChatMessage, PromptType
from inferno.engine.llm_engine import LLMEngine
from inferno.loader.calibration_file import default_calibration_path, write_calibration
from inferno.loader.tokenizer import Tokenizer
from inferno.lora_request import LoRARequest
from inferno.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from inferno.pooling_params import PoolingParams
from inferno.sampling_params import RequestOutputKind, SamplingParams

CALIBRATION_SEQUENCE_TOKENS = 256  # calibration texts run as prefills of at most this many tokens


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter of every prompt, or a list with one per prompt (None: the base model);
        the engine needs enable_lora=True."""
        sampling_params = sampling_params or SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = replace(sampling_params, output_kind=RequestOutputKind.FINAL_ONLY)
        else:
            sampling_params = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in sampling_params]
        return self._run_requests(prompts, sampling_params, SamplingParams, use_tqdm, lora_request)

    def _run_requests(self, prompts: PromptType | Sequence[PromptType], params, kind: type, use_tqdm: bool,
                      lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list:
        """Add one request per prompt (`params`: one of `kind` for all, or one each; `lora_request` likewise) and
        run them to the end."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = [params] * len(prompts) if isinstance(params, kind) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} {kind.__name__}")
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        request_ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(request_id, prompt, p, lora_request=lora)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt: the final hidden states pooled as the model's pooler config says (a
        sentence-transformers folder's Pooling and Normalize modules; by default the last token's, normalized).
        Works with either runner. Raises RuntimeError when a request failed."""
        outputs = self.encode(prompts, pooling_params, use_tqdm)
        failed = next((o for o in outputs if o.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"embedding request {failed.request_id} failed: {failed.error}")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The pooled vectors as tensors (vLLM's LLM.encode); failed requests carry their error."""
        return self._run_requests(prompts, pooling_params or PoolingParams(), PoolingParams, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], beam_width: int, max_tokens: int,
                    length_penalty: float = 1.0, early_stopping: bool | str = False, ignore_eos: bool = False,
                    use_tqdm: bool = True) -> list[RequestOutput]:
        """Beam search as HF transformers' `generate(num_beams=beam_width, do_sample=False)`; each output holds
        all `beam_width` finished beams, best first."""
        params = SamplingParams(n=beam_width, use_beam_search=True, temperature=0.0, max_tokens=max_tokens,
                                length_penalty=length_penalty, early_stopping=early_stopping, ignore_eos=ignore_eos)
        return self.generate(prompts, params, use_tqdm)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def wait_for_warm_up(self, timeout: float | None = None) -> bool:
        """Block until the engine is at full speed: the background warm-ups (the compiled decode step, the weights on
        huge pages; a draft model's too) are over, or `timeout` seconds have passed. True if decode steps now run
        compiled. Generation never needs this (it runs during the warm-up); benchmarks of the steady state do."""
        return self.llm_engine.wait_for_warm_up(timeout)

    def reset_prefix_cache(self) -> int:
        return self.llm_engine.reset_prefix_cache()

    def chat(self, messages: list[ChatMessage] | list[list[ChatMessage]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`tools`: OpenAI-style tool definitions, for the chat template to list (the reply is text, as in vLLM's
        `LLM.chat`; the server parses tool calls out of it). `lora_request`: as in `generate`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        render = self.llm_engine.input_processor.render_chat
        prompts = [render(c, add_generation_prompt, tools, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def calibrate(self, output: str | None = None, texts: Sequence[str] | None = None,
                  smoothing: float | None = None) -> Path:
        """Calibrate every decoder projection of this (float) model for int8 activations on `texts` (default:
        CALIBRATION_TEXTS): SmoothQuant factors with migration strength `smoothing` (0: none; None: each projection
        type's own). Writes them to `output` (default: beside the model), the file `LLM(model,
        quantization="w8a8")` reads, and returns its path."""
        if smoothing is not None and not 0 <= smoothing <= 1:
            raise ValueError(f"smoothing must be in [0, 1], got {smoothing}")
        tokenizer = self.get_tokenizer()
        sequences = [ids[start:start + CALIBRATION_SEQUENCE_TOKENS]
                     for ids in (tokenizer.encode(t) for t in texts or CALIBRATION_TEXTS)
                     for start in range(0, len(ids), CALIBRATION_SEQUENCE_TOKENS)]
        if not sequences:
            raise ValueError("no calibration text")
        engine = self.llm_engine
        layers = engine.executor.calibrate_activations(sequences, smoothing)
        path = Path(output) if output else default_calibration_path(engine.model_path)
        write_calibration(path, engine.model_config, smoothing, sum(map(len, sequences)), layers)
        return path

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput | PoolingRequestOutput]:
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm or len(request_ids) < 2,
                  dynamic_ncols=True) as bar:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[r] for r in request_ids]
