"""Grammars of the engine's requests: compiled off the engine loop (one background thread, results cached per
schema), advanced by accepted tokens, and turned into each step's token bitmasks.

A request with a grammar waits in the scheduler until its grammar is compiled (`is_ready`); other requests keep
running meanwhile. A grammar that fails to compile, or takes longer than GRAMMAR_COMPILE_TIMEOUT_S, ends its
request with an error (`take_failed`). The bitmasks are plain data for the worker: per request one row of
ceil(vocab / 32) int32 words for the token it samples, or with draft tokens one row per verified position.
"""
import logging
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import llguidance
import torch

from inferno.loader.tokenizer import Tokenizer
from inferno.request import Request
from inferno.sampling_params import StructuredOutputsParams
from inferno.structured_output.grammar import Grammar, cache_key, grammar_spec, parser_limits

logger = logging.getLogger("inferno")

GRAMMAR_COMPILE_TIMEOUT_S = 30.0  # from the request's arrival at the compiler (queueing included)
MAX_CACHED_GRAMMARS = 256


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: logits rows are this wide (the tokenizer's may be smaller)
        self.compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferno-grammar")
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built by the compile thread, on first use
        self._mask_executor: llguidance.LLExecutor | None = None
        self.compiled: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()  # key -> unused matcher
        self.pending: dict[str, tuple[Future[llguidance.LLMatcher], float]] = {}  # request id -> compile, start
        self.grammars: dict[str, Grammar] = {}  # request id -> its grammar, once compiled

    # requests
    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        key = cache_key(params)
        future = self.compiled.get(key)
        if future is None:
            future = self.compiler.submit(self._compile, grammar_spec(params))
            self.compiled[key] = future
            while len(self.compiled) > MAX_CACHED_GRAMMARS:
                self.compiled.popitem(last=False)
        self.compiled.move_to_end(key)
        self.pending[request_id] = (future, time.monotonic())

    def is_ready(self, request_id: str) -> bool:
        """The request has no grammar or its grammar is compiled (then it gets its own matcher)."""
        entry = self.pending.get(request_id)
        if entry is None:
            return True
        future, _ = entry
        if not future.done() or future.exception() is not None:
            return False
        del self.pending[request_id]
        self.grammars[request_id] = Grammar(future.result().deep_copy())
        return True

    def take_failed(self) -> dict[str, str]:
        """Requests whose grammar failed to compile or timed out, with why; they are forgotten here."""
        failed, now = {}, time.monotonic()
        for request_id, (future, start) in list(self.pending.items()):
            if future.done() and future.exception() is not None:
                failed[request_id] = str(future.exception())
            elif not future.done() and now - start > GRAMMAR_COMPILE_TIMEOUT_S:
                failed[request_id] = (f"structured_outputs took longer than {GRAMMAR_COMPILE_TIMEOUT_S:.0f} s to "
                                      f"compile; simplify the schema or grammar")
        for request_id in failed:
            del self.pending[request_id]
        for key in [k for k, f in self.compiled.items() if f.done() and f.exception() is not None]:
            del self.compiled[key]  # a later request with the same grammar gets a fresh try (and error)
        return failed

    def wait_for_compile(self, timeout: float) -> None:
        """Block until a pending compile finishes, at most `timeout` seconds (nothing else can run)."""
        if self.pending:
            wait({future for future, _ in self.pending.values()}, timeout, FIRST_COMPLETED)

    def remove(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.grammars.pop(request_id, None)

    def grammar_of(self, request_id: str) -> Grammar | None:
        """The request's grammar (a sample of an n > 1 request starts on its first sample's compiled one)."""
        self.is_ready(request_id)
        return self.grammars.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.pending)

    def shutdown(self) -> None:
        self.compiler.shutdown(wait=False, cancel_futures=True)

    # steps
    def trim_drafts(self, requests: list[Request]) -> None:
        """Cut each constrained request's draft tokens at the first one its grammar does not allow."""
        for req in requests:
            grammar = self.grammar_of(req.request_id)
            if grammar is None or not req.spec_token_ids:
                continue
            n = grammar.num_valid_tokens(req.spec_token_ids)
            req.spec_token_ids = req.spec_token_ids[:n]
            if req.draft_probs is not None:
                req.draft_probs = req.draft_probs[:n] if n else None

    def bitmasks(self, sampling: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """For each constrained request that samples this step (request id -> its draft tokens): [1 + drafts,
        words] bitmask rows, the tokens allowed at the sampled position and after each draft."""
        rows = [(grammar.matcher, rid, drafts) for rid, drafts in sampling.items()
                if (grammar := self.grammar_of(rid)) is not None]
        if not rows:
            return {}
        starts, total = [], 0
        for _, _, drafts in rows:
            starts.append(total)
            total += 1 + len(drafts)
        import llguidance.torch  # not at the top: it imports torch._dynamo (slow), which no unconstrained run needs
        bitmask = llguidance.torch.allocate_token_bitmask(total, self.vocab_size)
        if self._mask_executor is None:
            self._mask_executor = llguidance.LLExecutor()
        plain = [(m, start) for (m, _, drafts), start in zip(rows, starts) if not drafts]
        with_drafts = [(m, start, drafts) for (m, _, drafts), start in zip(rows, starts) if drafts]
        if plain:
            llguidance.torch.fill_next_token_bitmask_par(self._mask_executor, plain, bitmask)
        if with_drafts:
            llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(self._mask_executor, with_drafts, bitmask)
        return {rid: bitmask[start:start + 1 + len(drafts)] for (_, rid, drafts), start in zip(rows, starts)}

    # compile thread
    def _compile(self, spec: str) -> llguidance.LLMatcher:
        if self._ll_tokenizer is None:
            tokenizer = self.tokenizer
            self._ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=self.vocab_size,
                                                        eos_token=sorted(tokenizer.eos_token_ids))
        matcher = llguidance.LLMatcher(self._ll_tokenizer, spec, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise ValueError(f"structured_outputs could not be compiled: {matcher.get_error().strip()}")
        return matcher
