"""AsyncLLM: the engine loop runs in a background thread; each request is an async stream of DELTA outputs.

The engine thread owns the LLMEngine. New requests and aborts reach it through a thread-safe command queue and
are applied between steps; outputs go back to the event loop with `call_soon_threadsafe`, one batch per step.
"""
import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

from inferno.engine.input_processor import PromptType
from inferno.engine.kv_transfer import KVTransferStats
from inferno.engine.llm_engine import LLMEngine
from inferno.executor import ExecutorDeadError
from inferno.loader.tokenizer import Tokenizer
from inferno.lora_request import LoRARequest
from inferno.outputs import PoolingRequestOutput, RequestOutput
from inferno.pooling_params import PoolingParams
from inferno.sampling_params import RequestOutputKind, SamplingParams
from inferno.spec_decode.metrics import SpecDecodingStats

logger = logging.getLogger("inferno")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (the message says why); other requests go on."""


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # 0..1
    num_preemptions: int  # since the engine started
    prefix_cache_queries: int  # prompt tokens looked up, since the engine started
    prefix_cache_hits: int  # of those, tokens found in the cache
    num_cached_blocks: int  # blocks in the prefix cache now
    num_computed_prompt_tokens: int = 0  # prompt tokens run through the model, since the engine started
    spec_decoding_stats: SpecDecodingStats | None = None  # since the engine started; None without speculation
    kv_transfer_stats: KVTransferStats | None = None  # None on a colocated instance


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, outputs: list[RequestOutput],
               ended: dict[str, str]) -> None:
        """Called in the engine thread after every step or batch of commands. `ended`: request id -> finish
        reason ("abort" | "error") of requests that ended without a final output."""


class RequestStream:
    """The DELTA outputs of one request, as an async iterator; ends after the final output or an abort."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.finished = False
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue: asyncio.Queue[RequestOutput | Exception | None] = asyncio.Queue()

    # called on the event loop
    def accept(self, error: Exception | None) -> None:
        if self.accepted.done():
            return
        if error is None:
            self.accepted.set_result(None)
        else:
            self.accepted.set_exception(error)

    def put(self, item: RequestOutput | Exception | None) -> None:
        """An output, an exception that ends the stream, or None: aborted."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, (RequestOutput, PoolingRequestOutput)):
            self.finished = item.finished
            return item
        self.finished = True
        if item is None:
            raise StopAsyncIteration
        raise item


@dataclass(slots=True)
class _AddRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    arrival_time: float
    stream: RequestStream
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _EngineCall:
    """A call on the engine between two steps (LoRA adapters); its result, or its exception, set on `done`."""
    call: Callable[[], object]
    done: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _ResetPrefixCache:
    done: asyncio.Future[int]


class _Shutdown:
    pass


class AsyncLLM:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 stat_loggers: list[StatLogger] | None = None):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers = stat_loggers or []
        self.num_waiting_requests = 0  # published by the engine thread after every step
        # requests handed to the engine thread and not yet in its queue (aborts and other commands are not requests)
        self._pending_adds = 0
        self._pending_adds_lock = threading.Lock()
        self._commands: queue.SimpleQueue[_AddRequest | _Abort | _ResetPrefixCache | _EngineCall | _Shutdown] = \
            queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # live requests; engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False  # set by the engine thread as it exits

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # lifecycle (event loop side)
    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        assert self._thread is None, "AsyncLLM already started"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run_engine_loop, name="inferno-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread after its current step; live requests end with an error."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_Shutdown())
            self._thread.join()

    @property
    def is_running(self) -> bool:
        """The engine loop runs and every rank of the engine's executor is alive."""
        return self._thread is not None and not self._stopped and self.engine.is_healthy()

    @property
    def is_overloaded(self) -> bool:
        """True when the waiting queue is full; requests not yet applied count as waiting."""
        if self.max_waiting_requests is None:
            return False
        return self.num_waiting_requests + self._pending_adds >= self.max_waiting_requests

    # requests (event loop side)
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                          arrival_time: float | None = None, lora_request: LoRARequest | None = None
                          ) -> RequestStream:
        """Hand a request to the engine; returns its stream once the engine accepted it. Raises what
        `LLMEngine.add_request` raises (ValueError for bad input, a LoRA adapter that does not fit), EngineDeadError
        when the loop is down."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        if isinstance(params, SamplingParams):  # an embedding request has one output anyway
            params = replace(params, output_kind=RequestOutputKind.DELTA)
        stream = RequestStream(request_id)
        with self._pending_adds_lock:
            self._pending_adds += 1
        self._commands.put(_AddRequest(request_id, prompt, params, arrival_time or time.time(), stream,
                                       lora_request))
        if self._stopped:  # the engine thread exited after the check above and may not have seen the command
            stream.accept(EngineDeadError("the engine loop is not running"))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's AsyncLLM.generate: DELTA outputs of one request; leaving the loop early aborts it."""
        stream = await self.add_request(request_id, prompt, sampling_params, lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request; its blocks are freed before the next step. Unknown or finished ids are ignored."""
        self._commands.put(_Abort(request_id))

    # LoRA adapters (event loop side): applied by the engine thread between two steps
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read the adapter and check it against the model (ValueError if it does not fit); False if added already."""
        return await self._call_engine(partial(self.engine.add_lora, lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter (requests running with it finish with it); False if it was not added."""
        return await self._call_engine(partial(self.engine.remove_lora, lora_int_id))

    async def list_loras(self) -> set[int]:
        return await self._call_engine(self.engine.list_loras)

    async def _call_engine(self, call: Callable[[], object]):
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        done = asyncio.get_running_loop().create_future()
        self._commands.put(_EngineCall(call, done))
        return await done

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (between two steps); returns how many there were."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        done = asyncio.get_running_loop().create_future()
        self._commands.put(_ResetPrefixCache(done))
        return await done

    # engine thread
    def _run_engine_loop(self) -> None:
        try:
            while self._apply_commands():
                if self.engine.has_unfinished_requests() or self.engine.has_pending_kv_transfers():
                    self._step()
        except Exception:
            logger.exception("engine loop crashed")
        finally:
            self._stopped = True
            error = EngineDeadError("the engine loop stopped")
            self._end_all(error)
            self._reject_pending(error)

    def _apply_commands(self) -> bool:
        """Apply queued commands (waiting for one while the engine is idle); False on shutdown."""
        idle = not self.engine.has_unfinished_requests() and not self.engine.has_pending_kv_transfers()
        commands = [self._commands.get()] if idle else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        callbacks: list[Callable[[], None]] = []
        ended: dict[str, str] = {}
        keep_running = True
        num_adds = sum(isinstance(command, _AddRequest) for command in commands)
        for command in commands:
            match command:
                case _AddRequest(request_id, prompt, params, arrival_time, stream, lora_request):
                    try:
                        self.engine.add_request(request_id, prompt, params, arrival_time, lora_request)
                    except Exception as e:
                        callbacks.append(partial(stream.accept, e))
                        continue
                    self._streams[request_id] = stream
                    callbacks.append(partial(stream.accept, None))
                case _Abort(request_id):
                    stream = self._streams.pop(request_id, None)
                    if stream is None:
                        continue
                    self._abort_in_engine(request_id)
                    ended[request_id] = "abort"
                    callbacks.append(partial(stream.put, None))
                case _ResetPrefixCache(done):
                    callbacks.append(partial(done.set_result, self.engine.reset_prefix_cache()))
                case _EngineCall(call, done):
                    try:
                        callbacks.append(partial(_settle, done, call(), None))
                    except Exception as e:
                        callbacks.append(partial(_settle, done, None, e))
                case _Shutdown():
                    keep_running = False
        self._record_stats([], ended)
        with self._pending_adds_lock:  # counted as waiting (or running) from now on
            self._pending_adds -= num_adds
        self._dispatch(callbacks)
        return keep_running

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except ExecutorDeadError as e:  # a worker rank died: nothing can be served any more; the loop stops
            self._end_all(EngineDeadError(f"the engine stopped: {e}"))
            raise
        except Exception as e:  # the engine could not finish the step: end what was in flight, keep serving
            logger.exception("engine step failed; ending the %d requests in flight", len(self._streams))
            self._end_all(RequestFailedError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        callbacks: list[Callable[[], None]] = []
        ended: dict[str, str] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.error is not None:
                if not output.finished:  # other samples of the request are still running
                    self.engine.abort_request(output.request_id)
                    ended[output.request_id] = "error"
                del self._streams[output.request_id]
                callbacks.append(partial(stream.put, RequestFailedError(output.error)))
                continue
            if output.finished:
                del self._streams[output.request_id]
            callbacks.append(partial(stream.put, output))
        self._record_stats(outputs, ended)
        self._dispatch(callbacks)

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("could not abort request %s", request_id)

    def _end_all(self, error: Exception) -> None:
        callbacks: list[Callable[[], None]] = []
        ended: dict[str, str] = {}
        for request_id, stream in self._streams.items():
            self._abort_in_engine(request_id)
            ended[request_id] = "error"
            callbacks.append(partial(stream.put, error))
        self._streams.clear()
        self._record_stats([], ended)
        self._dispatch(callbacks)

    def _reject_pending(self, error: Exception) -> None:
        callbacks: list[Callable[[], None]] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _AddRequest):
                callbacks.append(partial(command.stream.accept, error))
            elif isinstance(command, _ResetPrefixCache):
                callbacks.append(partial(command.done.set_exception, error))
        self._dispatch(callbacks)

    def _dispatch(self, callbacks: list[Callable[[], None]]) -> None:
        if not callbacks:
            return
        try:
            self._loop.call_soon_threadsafe(_run_all, callbacks)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _record_stats(self, outputs: list[RequestOutput], ended: dict[str, str]) -> None:
        """Before the outputs are handed over, so a client that got its answer sees it counted."""
        scheduler, kv_cache = self.engine.scheduler, self.engine.kv_cache_manager
        kv_transfers = self.engine.kv_transfers
        stats = SchedulerStats(num_running_reqs=len(scheduler.running), num_waiting_reqs=len(scheduler.waiting),
                               kv_cache_usage=self.engine.kv_cache_usage,
                               num_preemptions=scheduler.num_preemptions,
                               prefix_cache_queries=kv_cache.prefix_cache_queries,
                               prefix_cache_hits=kv_cache.prefix_cache_hits,
                               num_cached_blocks=kv_cache.block_pool.num_cached_blocks,
                               num_computed_prompt_tokens=scheduler.num_computed_prompt_tokens,
                               spec_decoding_stats=scheduler.spec_decoding_stats,
                               kv_transfer_stats=None if kv_transfers is None else kv_transfers.take_stats())
        self.num_waiting_requests = stats.num_waiting_reqs
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats, outputs, ended)
            except Exception:
                logger.exception("stat logger %s failed", type(stat_logger).__name__)


def _settle(done: asyncio.Future, result: object, error: Exception | None) -> None:
    """On the event loop: an engine call's result or exception (made on the engine thread) to its caller."""
    if not done.done():  # the caller may have been cancelled meanwhile
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)


def _run_all(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        callback()
