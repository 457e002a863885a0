"""Runs one scheduled step: flat input tensors from the schedule, the forward pass(es), sampling."""
import atexit
import ctypes
import logging
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Protocol

import torch

from inferno.config import DTYPES, EngineConfig, ModelConfig
from inferno.distributed.parallel_state import SINGLE, ParallelRank
from inferno.core.kv_blocks import cdiv
from inferno.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from inferno.layers.attention import select_attention_backend
from inferno.layers.rejection_sampler import Drafts, rejection_sample
from inferno.layers.kv_quantization import KV_CACHE_DTYPES, kv_element_bytes
from inferno.layers.lora import LoRAMapping
from inferno.layers.quantization.linear import QuantizedLinear
from inferno.layers.sampler import Sampler, SamplingMetadata, gather_logprobs
from inferno.model.llama import LlamaForCausalLM
from inferno.sampling_params import SamplingParams
from inferno.worker.input_batch import MicroBatch, StepInput, StepPlan, plan_step
from inferno.worker.pipeline import run_first_stage, run_later_stage
from inferno.worker.compile_cache import (clear_compile_cache, compile_cache_hits, precompiled_key, precompiled_path,
                                         read_precompiled, stable_block_capacity, use_compile_cache, write_precompiled)
from inferno.worker.compiled_decode import (CompiledDecode, compile_graphs, compile_options, load_graphs,
                                           scratch_inputs, warm_up_graphs)
from inferno.worker.cpu_malloc import keep_freed_memory
from inferno.worker.cuda_graphs import DecodeGraphs
from inferno.worker.huge_pages import move_weights_to_huge_pages
from inferno.worker.kv_cache import available_memory, lazily_zeroed
from inferno.worker.lora_manager import LoRAManager
from inferno.worker.pooler import pool
from inferno.worker.request_state import CachedRequestState, update_states
from inferno.worker.spec_decode.target_hidden import TargetHiddenStates


logger = logging.getLogger("inferno")

# the warm-up thread's niceness: serving keeps its core, yet the thread (which holds the GIL while tracing) is not
# starved for long by other processes, which would stall the serving thread waiting for the GIL
WARM_UP_NICENESS = 10
# seconds the warm-up waits for the first step to be over (the first token of `inferno generate`: tracing holds the
# GIL, and the copy to huge pages takes memory bandwidth), then starts anyway
WARM_UP_DELAY = 1.0
# seconds the serving thread may wait for the GIL while the warm-up compiles (Python's default is 5 ms)
WARM_UP_SWITCH_INTERVAL = 0.0002
# seconds the interpreter's exit waits for a warm-up thread to stop (see stop_warm_ups)
WARM_UP_STOP_WAIT = 10.0


def kv_bytes_per_block(config: ModelConfig, block_size: int, kv_cache_dtype: str) -> int:
    """`kv_cache_dtype`: a resolved EngineConfig.kv_cache_dtype."""
    element = kv_element_bytes(kv_cache_dtype, config.head_dim)
    return int(2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element)


class ModelRunner:
    """One rank's model, KV cache shard and request states; `execute_model` runs a step on it."""

    def __init__(self, model: LlamaForCausalLM, engine_config: EngineConfig, num_blocks: int,
                 parallel: ParallelRank = SINGLE, device: torch.device = torch.device("cpu")):
        self.model = model
        self.device = device
        self.config = model.config
        self.parallel = parallel
        self.block_size = engine_config.block_size
        self.num_blocks = num_blocks
        quantized_kv = engine_config.quantized_kv_cache
        self.dtype = engine_config.torch_dtype
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}  # every request the scheduler has not finished
        # rank 0, for proposers that read the target's hidden states (Medusa heads): request id -> (position, final
        # hidden state there, before the final norm) of each request's last accepted position in the last step.
        # None (the default) keeps nothing.
        self.draft_hidden: dict[str, tuple[int, torch.Tensor]] | None = None
        self._logit_hidden: torch.Tensor | None = None  # the last step's logit rows' hidden states, while kept
        # rank 0, for an EAGLE head, which reads the target's hidden states at every accepted position (not only
        # the last): None (the default) keeps nothing
        self.target_hidden: TargetHiddenStates | None = None
        self._step_hidden: list[tuple[MicroBatch, torch.Tensor]] = []  # this step's, until sampling tells what to keep
        keep_freed_memory()
        # LoRA adapters: stacks on the projections (before the warm-up compiles the decode step with them)
        self.lora = LoRAManager(model, engine_config, device) if engine_config.enable_lora else None
        # Decode-only steps of a single-rank model with the native kernel switch to a torch.compile'd forward once
        # a background thread has compiled it (see _compile_decode_step); until then they run eagerly.
        self.compiled_decode: CompiledDecode | None = None
        # a compiled or captured decode step (single rank, not MoE: its routing is data-dependent control flow) is
        # warmed up on one block beyond the pool, a scratch block no request can hold; an embedding model
        # (runner="pooling") never decodes, so it compiles nothing that would take cores from its prompts
        fast_decode = (not engine_config.enforce_eager and parallel.world_size == 1 and self.config.moe is None
                       and engine_config.runner != "pooling")
        self.scratch_block = num_blocks if fast_decode else None
        self.num_cache_blocks = num_blocks + fast_decode
        if fast_decode and device.type == "cpu":  # the compiled step's shapes the same from start to start
            self.num_cache_blocks = stable_block_capacity(self.num_cache_blocks)
        self.attention = select_attention_backend(
            engine_config.attention_backend, device, self.block_size, model.attention_layers[0].num_kv_heads,
            self.num_cache_blocks, self.config.head_dim, self.config.sliding_window, quantized_kv,
            self.config.attn_logit_softcapping)
        compile_decode = fast_decode and self.attention.compiles_decode_step
        # zeros, not garbage: masked-out slots are still multiplied by zero weights, and stale NaN/inf would turn
        # that into NaN. On the CPU the OS zero-fills the pages on first touch, so start-up writes nothing.
        cache_dtype = (KV_CACHE_DTYPES if quantized_kv else DTYPES)[engine_config.kv_cache_dtype]
        for attn in model.attention_layers:
            shape = (attn.num_kv_heads, self.num_cache_blocks, self.block_size, self.config.head_dim)  # this rank's
            attn.backend = self.attention
            attn.k_cache = self._zeros(shape, cache_dtype)
            attn.v_cache = self._zeros(shape, cache_dtype)
            if quantized_kv:
                attn.k_scale = self._zeros(shape[:-1], torch.float32)
                attn.v_scale = self._zeros(shape[:-1], torch.float32)
        # GPU: decode-only steps replay CUDA graphs captured now
        self.decode_graphs = None
        if fast_decode and device.type == "cuda" and self.attention.captures_decode_graphs:
            max_model_len = engine_config.max_model_len or self.config.max_position_embeddings
            self.decode_graphs = DecodeGraphs(self._decode_forward, engine_config.max_num_seqs,
                                              cdiv(max_model_len, self.block_size), self.scratch_block, device)
        # The quantized weights are regrouped into tiles (CPU) by the warm-up once the first step is over (or before
        # any, WARM_UP_DELAY seconds after start-up), else at the start of the second step: never during a step
        # (each holds `tiling`), so the first step runs every layer on the stored blocks and every later step every
        # layer on tiles, and the same requests get the same tokens in every run (a switch at a token that depended
        # on timing changed them: the kernels round differently in the last bit, which the next layer's int8
        # activations amplify). The first token is not held up by it.
        self.tiling = threading.Lock()
        self.tiled = device.type != "cpu"
        # the background warm-up: the decode step compiled, then the weights moved onto huge pages (CPU); it starts
        # after the first step (or WARM_UP_DELAY seconds without one), which it would slow down
        self.first_step_done = threading.Event()
        self.warm_up_thread: threading.Thread | None = None
        if compile_decode or device.type == "cpu":
            self.warm_up_thread = threading.Thread(target=self._warm_up, args=(compile_decode,),
                                                   name="inferno-warm-up", daemon=True)
            self.warm_up_thread.start()
            WARMING_UP.add(self)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return lazily_zeroed(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def kv_caches(self) -> list[torch.Tensor]:
        """Every layer's cache tensors ([kv_heads, blocks, ...]: K, V and a quantized cache's scales), in order."""
        caches = []
        for attn in self.model.attention_layers:
            caches += [attn.k_cache, attn.v_cache]
            if attn.k_scale is not None:
                caches += [attn.k_scale, attn.v_scale]
        return caches

    def wait_for_warm_up(self, timeout: float | None = None) -> bool:
        """Block until the background warm-up is over (the steady state); True if decode steps now run compiled."""
        if self.warm_up_thread is not None:
            self.warm_up_thread.join(timeout)
        return self.compiled_decode is not None

    def _warm_up(self, compile_decode: bool) -> None:
        """The warm-up thread, at a lower OS priority (Linux), as are the compiler processes it starts, so serving
        keeps its core."""
        lower_thread_priority()
        switch_interval = sys.getswitchinterval()
        try:
            self.first_step_done.wait(WARM_UP_DELAY)
            with self.tiling:  # after the first step (or before any, on an idle engine), unless the second did
                self._tile_once()
            if compile_decode:
                # Tracing and code generation hold the GIL, which the serving thread gives up in every op call
                # and then waits for, up to a switch interval each time (the convoy effect): at the default 5 ms,
                # a SmolLM2 decode step's few hundred calls took seconds
                sys.setswitchinterval(WARM_UP_SWITCH_INTERVAL)
                try:
                    self._compile_decode_step()
                finally:
                    sys.setswitchinterval(switch_interval)
            if self.device.type == "cpu":
                try:
                    move_weights_to_huge_pages(self.model)
                except Exception:  # an optimisation: serving goes on from the pages the weights are on
                    logger.exception("moving the weights onto huge pages failed; they stay where they are")
        except WarmUpStopped:  # the interpreter is exiting
            pass

    def stop_warm_up(self) -> None:
        """End the warm-up thread where it is, for the interpreter's exit (see stop_warm_ups): raises WarmUpStopped
        in it, which takes effect at its next Python instruction (a tile, a traced op, a huge-page chunk)."""
        thread = self.warm_up_thread
        if thread is not None and thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(WarmUpStopped))
            thread.join(WARM_UP_STOP_WAIT)

    def _tile_once(self) -> None:
        """Tiles (`_tile_weights`) unless made already; with `tiling` held."""
        if not self.tiled:
            self._tile_weights()
            self.tiled = True

    def _tile_weights(self) -> None:
        """Regroup the quantized weights that have tiles (`QuantizedLinear.tile`), unless the copies would take over
        half the memory available."""
        layers = [m for m in self.model.modules() if isinstance(m, QuantizedLinear) and m.can_tile]
        size = sum(m.weight.nbytes for m in layers)
        if not layers or size > available_memory() // 2:
            if layers:
                logger.info("weights stay untiled: tiles of %.2f GiB would take over half the memory available",
                            size / 2**30)
            return
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                for layer in layers:
                    layer.tile()
        except Exception:  # an optimisation: the layers not tiled run their stored blocks
            logger.exception("regrouping the weights into tiles failed")
            return
        logger.info("%d quantized weights regrouped into tiles (%.2f GiB) in %.2f s", len(layers), size / 2**30,
                    time.perf_counter() - start)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step on this rank: its requests brought up to date, the flat batches planned (every rank alike, one
        micro-batch per pipeline stage), the forward pass; rank 0 samples and returns the output."""
        with self.tiling:
            if self.first_step_done.is_set():  # from the second step on (the warm-up may have tiled meanwhile)
                self._tile_once()
            update_states(self.requests, sched, self.device)
            plan = plan_step(sched, self.requests, self.block_size, self.parallel.pp_size)
            logits, pooling_hidden = self.forward_step(plan.step)
            output = self.sample(plan, logits, sched.grammar_bitmask) if self.parallel.rank == 0 else None
            if output is not None and plan.pooling:  # pooling requests' chunks (some may read none of their rows)
                normed = self.model.norm(pooling_hidden).float() if pooling_hidden is not None else None
                output.pooler_output = pool(plan.pooling, normed)
        if not self.first_step_done.is_set():  # once: Event.set takes a lock
            self.first_step_done.set()
        return output

    @torch.inference_mode()
    def run_step(self, step: StepInput) -> torch.Tensor | None:
        """Logits [step.num_logit_rows, vocab] on rank 0; None on the other ranks."""
        return self.forward_step(step)[0]

    def forward_step(self, step: StepInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits [step.num_logit_rows, vocab] and the final hidden states of the pooling rows (before the final
        norm) [step.num_pooling_rows, hidden], on rank 0 (the hidden states on every rank of the first stage)."""
        self._step_hidden = []
        if step.block_copies:
            sources, destinations = torch.tensor(step.block_copies, dtype=torch.long, device=self.device).unbind(1)
            for attn in self.model.attention_layers:
                attn.copy_blocks(sources, destinations)
        if self.parallel.pp_size == 1:
            batches = step.micro_batches
            outputs = (output_rows(self._keep_step_hidden(mb, self.forward(mb)), mb.output_rows) for mb in batches)
        elif not self.parallel.is_first_stage:
            run_later_stage(self.forward, step, self.parallel, self.config.hidden_size, self.dtype, self.device)
            return None, None
        else:
            batches = [mb for mb in step.micro_batches if mb.output_rows]
            outputs = run_first_stage(self.forward, step, self.parallel, self.config.hidden_size, self.dtype,
                                      self.device)
        logits, pooling, logit_hidden = [], [], []
        # with stages, each micro-batch's logits as it comes back (the generator first: it ends by waiting on its sends)
        for hidden, mb in zip(outputs, batches):
            if mb.logit_rows:
                logit_hidden.append(hidden[:len(mb.logit_rows)])
                logits.append(self.model.compute_logits(logit_hidden[-1]))
            pooling.append(hidden[len(mb.logit_rows):])
        logits = (logits[0] if len(logits) == 1 else torch.cat(logits)) if logits and logits[0] is not None else None
        if self.draft_hidden is not None:
            self._logit_hidden = torch.cat(logit_hidden) if logit_hidden else None
        return logits, torch.cat(pooling) if step.num_pooling_rows else None

    def _keep_step_hidden(self, mb: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
        if self.target_hidden is not None:
            self._step_hidden.append((mb, hidden))
        return hidden

    def forward(self, mb: MicroBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's output hidden states for one flat batch (`hidden`: the previous stage's)."""
        decodes = mb.decodes
        lora = self._lora_mapping(mb)
        if self.decode_graphs is not None and not mb.prefills and hidden is None and lora is None:
            out = self.decode_graphs.run(mb.input_ids, mb.positions, mb.slot_mapping, decodes)
            if out is not None:
                return out
        input_ids, positions = (torch.tensor(values, dtype=torch.long, device=self.device)
                                for values in (mb.input_ids, mb.positions))
        compiled = self.compiled_decode
        if compiled is not None and not mb.prefills and hidden is None:
            width = max(len(table) for _, table in decodes)
            tables = torch.tensor([table + [0] * (width - len(table)) for _, table in decodes], dtype=torch.long)
            seq_lens = torch.tensor([seq_len for seq_len, _ in decodes])
            out = compiled.run(self.model, self.attention, input_ids, positions, torch.tensor(mb.slot_mapping),
                               tables, seq_lens, None if lora is None else lora.token_slots)
            if out is not None:
                return out
        meta = self.attention.build_metadata(mb.slot_mapping, decodes, mb.prefills)
        return self.model(input_ids, positions, meta, hidden, lora)

    def _lora_mapping(self, mb: MicroBatch) -> LoRAMapping | None:
        """The adapter slot of each token of the batch, the adapters put into slots; None without adapters."""
        if self.lora is None or not any(mb.lora_ids):
            return None
        requests = {s.lora_int_id: s.lora_request for s in self.requests.values() if s.lora_request is not None}
        return self.lora.mapping(mb.lora_ids, requests)

    def _compile_decode_step(self) -> None:
        """The warm-up's compile: the decode graphs (worker/compiled_decode.py) loaded from the compile cache, else
        compiled and saved there, then run once on the scratch block and handed to the serving thread
        (`compiled_decode`), which picks them up at its next step.

        Compiling here while the serving thread runs eager forwards of the same modules is safe: dynamo's frame
        hook, fake-tensor and dispatch modes, grad/inference mode are all per thread, and tracing only reads the
        modules. The warm-up calls do run the graphs on the real caches, but write only the scratch block."""
        folder = use_compile_cache()
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                compiled = self._load_or_compile(folder)
        except Exception:
            logger.exception("compiling the decode step failed; decode steps stay eager")
            return
        self.compiled_decode = compiled
        logger.info("decode steps run compiled from now on (warmed up in %.1f s; compile cache %s)",
                    time.perf_counter() - start, folder)

    def _load_or_compile(self, folder: Path) -> CompiledDecode:
        """The precompiled step of this model and configuration if the compile cache has a sound one, else the step
        compiled (once more from scratch where an entry of inductor's caches broke it) and saved."""
        scratch = (self.model, self.attention, self.scratch_block, self.block_size)
        start = time.perf_counter()
        options = compile_options()  # imports inductor and runs its ISA probe: most of this phase
        options_made = time.perf_counter()
        # what the trace reads: the model and its attention backend (the engine's options as they hold them: the KV
        # caches' dtype and capacity, the backend, the quantized layers), and inductor's options
        path = precompiled_path(folder, precompiled_key(self.model, self.attention, options))
        logger.info("decode step: looking for its precompiled graphs (inductor loaded in %.2f s, key made in %.2f s)",
                    options_made - start, time.perf_counter() - options_made)
        if (serialized := read_precompiled(path)) is not None:
            try:
                return self._load_graphs(serialized, path)
            except Exception:
                logger.exception("the precompiled decode step %s cannot be used; compiling afresh", path)
                path.unlink(missing_ok=True)
                clear_compile_cache(folder)  # its libraries may be what broke
        self._decode_forward(*scratch_inputs(1, self.scratch_block, self.block_size)[:5])  # fused_cpu's lazy picks
        hits = compile_cache_hits()
        try:
            compiled = compile_graphs(*scratch)
            warm_up_graphs(compiled, *scratch)
        except Exception:
            if compile_cache_hits() == hits:
                raise
            logger.exception("a compiled decode graph from the compile cache failed; compiling afresh")
            clear_compile_cache(folder)
            compiled = compile_graphs(*scratch)
            warm_up_graphs(compiled, *scratch)
        write_precompiled(path, compiled.serialized)
        return compiled

    def _load_graphs(self, serialized: dict[str, bytes], path: Path) -> CompiledDecode:
        start = time.perf_counter()
        compiled = load_graphs(serialized)
        loaded = time.perf_counter()
        warm_up_graphs(compiled, self.model, self.attention, self.scratch_block, self.block_size)
        logger.info("decode graphs loaded from %s in %.1f s (no tracing), first calls %.1f s", path.name,
                    loaded - start, time.perf_counter() - loaded)
        return compiled

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """The model over one decode token per request (what CUDA graphs capture; compiled_decode.decode_step)."""
        return self.model(input_ids, positions, self.attention.decode_metadata(slot_mapping, block_tables, seq_lens))

    def sample(self, plan: StepPlan, logits: torch.Tensor | None,
               grammar_bitmask: dict[str, torch.Tensor] | None = None) -> ModelRunnerOutput:
        """`grammar_bitmask`: request id -> the tokens its grammar allows at each position it samples."""
        out = ModelRunnerOutput(sampled_token_ids={})
        bitmasks = grammar_bitmask or {}
        requests = plan.sample_requests
        if requests:
            md = sampling_metadata([(r, []) for r in requests], self.config.vocab_size,
                                   [bitmasks.get(r.request_id) for r in requests], self.device)
            result = self.sampler(output_rows(logits, plan.sample_rows), md)
            sampled = result.sampled_token_ids.tolist()
            for i, req in enumerate(requests):
                out.sampled_token_ids[req.request_id] = [sampled[i]]
            if result.logprobs is not None:
                ids, values, ranks = result.logprob_token_ids.tolist(), result.logprobs.tolist(), result.sampled_ranks.tolist()
                for i, req in enumerate(requests):
                    if req.sampling_params.logprobs is not None:
                        k = 1 + req.sampling_params.logprobs
                        out.logprobs[req.request_id] = (ids[i][:k], values[i][:k], ranks[i])
        if plan.spec_requests:
            self._verify_drafts(plan, logits, out, bitmasks)
        if self.draft_hidden is not None:
            self._keep_draft_hidden(plan, out)
        if self.target_hidden is not None:
            self._keep_target_hidden(plan, out)
        for req, rows, targets in plan.prompt_logprob_rows:
            logprobs = logits[rows].log_softmax(dim=-1)
            result = gather_logprobs(logprobs, torch.tensor(targets, device=self.device),
                                     req.sampling_params.prompt_logprobs)
            out.prompt_logprobs.setdefault(req.request_id, []).extend(zip(
                result.logprob_token_ids.tolist(), result.logprobs.tolist(), result.sampled_ranks.tolist()))
        return out

    def _keep_draft_hidden(self, plan: StepPlan, out: ModelRunnerOutput) -> None:
        """`draft_hidden` for the requests that emitted tokens this step (the only ones drafting after it): the
        hidden state of the position whose logits gave their last token."""
        rows, kept = list(plan.sample_rows), [(r.request_id, r.num_tokens - 1) for r in plan.sample_requests]
        first = 0
        for req, drafts in zip(plan.spec_requests, plan.spec_token_ids):
            num_accepted = len(out.sampled_token_ids[req.request_id]) - 1
            rows.append(plan.spec_rows[first + num_accepted])
            kept.append((req.request_id, req.num_tokens - 1 + num_accepted))
            first += len(drafts) + 1
        hidden = self._logit_hidden[torch.tensor(rows, dtype=torch.long, device=self.device)] if rows else None
        self.draft_hidden = {rid: (position, hidden[i]) for i, (rid, position) in enumerate(kept)}
        self._logit_hidden = None

    def _keep_target_hidden(self, plan: StepPlan, out: ModelRunnerOutput) -> None:
        """`target_hidden` gets the hidden states of every position this step ran, but for rejected drafts."""
        num_kept = {r.request_id: len(out.sampled_token_ids.get(r.request_id, ())) for r in plan.spec_requests}
        for mb, hidden in self._step_hidden:
            for request_id, row, start, n in mb.request_rows:
                self.target_hidden.record(request_id, start, hidden[row:row + num_kept.get(request_id, n)])
        self.target_hidden.keep_only(self.requests)
        self._step_hidden = []

    def _verify_drafts(self, plan: StepPlan, logits: torch.Tensor, out: ModelRunnerOutput,
                       bitmasks: dict[str, torch.Tensor]) -> None:
        """Target logits at all 1 + k positions of each speculating request -> rejection sampling."""
        metadata_rows, drafts, row_bitmasks = [], [], []
        for req, tokens, probs in zip(plan.spec_requests, plan.spec_token_ids, plan.spec_draft_probs):
            metadata_rows.extend((req, tokens[:j]) for j in range(len(tokens) + 1))
            drafts.append(Drafts(tokens, probs, req.generator))
            bitmask = bitmasks.get(req.request_id)
            row_bitmasks.extend([None] * (len(tokens) + 1) if bitmask is None else bitmask)
        md = sampling_metadata(metadata_rows, self.config.vocab_size, row_bitmasks, self.device)
        emitted = rejection_sample(logits[plan.spec_rows], md, drafts)
        for req, tokens in zip(plan.spec_requests, emitted):
            out.sampled_token_ids[req.request_id] = tokens


def output_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows]: the first rows as they are where those are all of them in order (every decode step), without
    an indexing operator's copy."""
    return hidden[:len(rows)] if rows == list(range(len(rows))) else hidden[rows]


class WarmUpStopped(BaseException):
    """Raised in a warm-up thread at the interpreter's exit (a BaseException: no `except Exception` swallows it)."""


# Runners whose warm-up thread may still run. A daemon thread still inside a C++ call (a torch op, the compiler) as
# Python 3.11 finalizes is ended by pthread_exit, whose unwinding through noexcept C++ frames aborts the process
# ("terminate called without an active exception", exit code 134): `inferno generate` used to end so whenever its
# answer came before the warm-up's end. The threads are stopped first, while the interpreter is whole.
WARMING_UP: "weakref.WeakSet[ModelRunner]" = weakref.WeakSet()


@atexit.register
def stop_warm_ups() -> None:
    for runner in list(WARMING_UP):
        runner.stop_warm_up()


def lower_thread_priority() -> None:
    """Nice the calling thread (and the processes it starts) on Linux, where a thread has a priority of its own."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WARM_UP_NICENESS)
    except (AttributeError, OSError):
        pass


class SamplingState(Protocol):
    """What sampling reads of a request: the worker's CachedRequestState, or a DraftingRequest (draft model)."""
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    eos_token_ids: set[int]
    generator: torch.Generator | None

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def output_token_ids(self) -> list[int]: ...


def sampling_metadata(rows: list[tuple[SamplingState, list[int]]], vocab_size: int,
                      bitmasks: list[torch.Tensor | None] | None = None,
                      device: torch.device = torch.device("cpu")) -> SamplingMetadata:
    """One row per (request, draft tokens before the position): penalties and min_tokens see the output so far
    plus those drafts. `bitmasks`: per row, the tokens its grammar allows (None: unconstrained). Tensors on
    `device`, the logits'."""
    requests = [r for r, _ in rows]
    params = [r.sampling_params for r in requests]
    temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=device)
    penalty_rows = [i for i, p in enumerate(params)
                    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty]
    banned = {}
    for i, (r, drafts) in enumerate(rows):
        if r.num_output_tokens + len(drafts) < r.sampling_params.min_tokens:
            banned[i] = sorted(r.eos_token_ids | set(r.sampling_params.stop_token_ids))
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    grammar_rows = [i for i, bitmask in enumerate(bitmasks or []) if bitmask is not None]

    def column(name: str, off, dtype) -> torch.Tensor | None:
        values = [getattr(p, name) for p in params]
        if name == "top_k":
            values = [min(k, vocab_size) for k in values]
        return None if all(v == off for v in values) else torch.tensor(values, dtype=dtype, device=device)

    def penalty(name: str) -> torch.Tensor | None:
        if not penalty_rows:
            return None
        return torch.tensor([getattr(params[i], name) for i in penalty_rows], device=device)

    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all(p.greedy for p in params),
        top_k=column("top_k", 0, torch.long),
        top_p=column("top_p", 1.0, torch.float32),
        min_p=column("min_p", 0.0, torch.float32),
        generators={i: r.generator for i, r in enumerate(requests) if r.generator is not None},
        penalty_rows=penalty_rows,
        repetition_penalty=penalty("repetition_penalty"),
        presence_penalty=penalty("presence_penalty"),
        frequency_penalty=penalty("frequency_penalty"),
        prompt_token_ids=[requests[i].prompt_token_ids for i in penalty_rows],
        output_token_ids=[requests[i].output_token_ids + rows[i][1] for i in penalty_rows],
        banned_token_ids={i: t for i, t in banned.items() if t},
        max_num_logprobs=max(wanted) if wanted else None,
        grammar_rows=grammar_rows,
        grammar_bitmask=torch.stack([bitmasks[i] for i in grammar_rows]) if grammar_rows else None,
    )
