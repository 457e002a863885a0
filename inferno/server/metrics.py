"""Prometheus metrics with vLLM's names under the `inferno:` prefix, recorded in the engine thread.

Latencies (vLLM's definitions), in seconds, per request:
  time_to_first_token = first output token - arrival; request_queue_time = first scheduled - arrival;
  e2e_request_latency = finished - arrival; request_time_per_output_token = (last token - first token) /
  (output tokens - 1); inter_token_latency = time between two outputs of a running request (one per step).
"""
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inferno.engine.async_llm import SchedulerStats
from inferno.engine.kv_transfer import KVTransferStats
from inferno.outputs import PoolingRequestOutput, RequestOutput
from inferno.spec_decode.metrics import SpecDecodingStats

FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)


@dataclass(slots=True)
class _RequestTimes:
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)  # sample index -> reason


class SpecDecodeMetrics:
    """vLLM's spec_decode counters, advanced by the growth of the engine's cumulative SpecDecodingStats."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"inferno:{name}", doc, ["model_name"], registry=registry).labels(model_name)

        self.num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.num_disabled_steps = counter("spec_decode_num_disabled_steps",
                                          "Steps without speculation because disable_by_batch_size was reached.")
        self.num_paused_proposals = counter("spec_decode_num_paused_proposals",
                                            "Request-steps without drafts because the request's acceptance was low.")
        self.per_pos = Counter("inferno:spec_decode_num_accepted_tokens_per_pos",
                               "Accepted tokens per draft position.", ["model_name", "position"], registry=registry)
        self.model_name = model_name
        self.seen = SpecDecodingStats(0)

    def record(self, stats: SpecDecodingStats) -> None:
        self.num_drafts.inc(stats.num_drafts - self.seen.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens - self.seen.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens - self.seen.num_accepted_tokens)
        self.num_disabled_steps.inc(stats.num_disabled_steps - self.seen.num_disabled_steps)
        self.num_paused_proposals.inc(stats.num_paused_proposals - self.seen.num_paused_proposals)
        seen_per_pos = self.seen.num_accepted_tokens_per_pos or [0] * stats.num_spec_tokens
        for pos, (now, before) in enumerate(zip(stats.num_accepted_tokens_per_pos, seen_per_pos)):
            self.per_pos.labels(self.model_name, str(pos)).inc(now - before)
        self.seen = SpecDecodingStats(stats.num_spec_tokens, stats.num_drafts, stats.num_draft_tokens,
                                      stats.num_accepted_tokens, list(stats.num_draft_tokens_per_pos),
                                      list(stats.num_accepted_tokens_per_pos), stats.num_disabled_steps,
                                      stats.num_paused_proposals)


class PrometheusStatLogger:
    """A StatLogger for AsyncLLM: gauges from the scheduler, counters and histograms from the outputs."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"inferno:{name}", doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"inferno:{name}", doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"inferno:{name}", doc, labels, buckets=buckets, registry=registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_cached_blocks = gauge("num_cached_blocks", "Number of KV-cache blocks in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.num_computed_prompt_tokens = counter(
            "prompt_tokens_computed", "Prompt tokens run through the model (prefix-cache hits and prompts whose KV "
                                      "came from a prefill instance excluded).")
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "KV-cache bytes sent (prefill) or received (decode).")
        self.kv_transfer_failures = counter("kv_transfer_failures",
                                            "KV transfers that failed or timed out (their blocks were freed).")
        self.kv_transfer_seconds = histogram("kv_transfer_seconds", "Histogram of the time of one request's KV "
                                                                    "transfer in seconds.", TRANSFER_BUCKETS)
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        request_success = Counter("inferno:request_success", "Count of successfully processed requests.",
                                  ["model_name", "finished_reason"], registry=registry)
        self.request_success = {reason: request_success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", TOKEN_BUCKETS)
        self.time_per_output_token = histogram("request_time_per_output_token_seconds",
                                               "Histogram of time_per_output_token_seconds per request.",
                                               TOKEN_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Histogram of time spent in WAITING phase for request.",
                                            REQUEST_BUCKETS)
        self._totals = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                        "num_computed_prompt_tokens": 0}
        self._kv_transfer_totals = KVTransferStats()
        self.spec_decode = SpecDecodeMetrics(registry, model_name)
        self._requests: dict[str, _RequestTimes] = {}

    def record(self, scheduler_stats: SchedulerStats, outputs: list[RequestOutput], ended: dict[str, str]) -> None:
        self.num_requests_running.set(scheduler_stats.num_running_reqs)
        self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(scheduler_stats.kv_cache_usage)
        self.num_cached_blocks.set(scheduler_stats.num_cached_blocks)
        for name, seen in self._totals.items():  # the engine keeps running totals; counters take the increase
            total = getattr(scheduler_stats, name)
            if total > seen:
                getattr(self, name).inc(total - seen)
                self._totals[name] = total
        if scheduler_stats.spec_decoding_stats is not None:
            self.spec_decode.record(scheduler_stats.spec_decoding_stats)
        if scheduler_stats.kv_transfer_stats is not None:
            self._record_kv_transfers(scheduler_stats.kv_transfer_stats)
        now = time.time()
        for output in outputs:
            self._record_output(output, now)
        for request_id, reason in ended.items():
            self._requests.pop(request_id, None)
            self.request_success[reason].inc()

    def _record_kv_transfers(self, stats: KVTransferStats) -> None:
        seen = self._kv_transfer_totals
        self.kv_transfer_bytes.inc(stats.num_bytes - seen.num_bytes)
        self.kv_transfer_failures.inc(stats.num_failures - seen.num_failures)
        for seconds in stats.new_seconds:
            self.kv_transfer_seconds.observe(seconds)
        self._kv_transfer_totals = KVTransferStats(stats.num_bytes, stats.num_failures)

    def _record_output(self, output: RequestOutput | PoolingRequestOutput, now: float) -> None:
        times = self._requests.get(output.request_id)
        if times is None:
            times = self._requests[output.request_id] = _RequestTimes()
            self.prompt_tokens.inc(len(output.prompt_token_ids))
        completions = output.outputs if isinstance(output, RequestOutput) else []  # an embedding generates none
        num_new_tokens = sum(len(c.token_ids) for c in completions)
        metrics = output.metrics
        if num_new_tokens:
            self.generation_tokens.inc(num_new_tokens)
            if times.first_token_time is None:
                times.first_token_time = now
                if metrics is not None:
                    self.time_to_first_token.observe(now - metrics.arrival_time)
                    if metrics.first_scheduled_time is not None:
                        self.request_queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
            else:
                self.inter_token_latency.observe(now - times.last_token_time)
            times.last_token_time = now
            times.num_generation_tokens += num_new_tokens
        for completion in completions:
            if completion.finish_reason is not None:
                times.finish_reasons[completion.index] = completion.finish_reason
        if not output.finished:
            return
        del self._requests[output.request_id]
        reason = times.finish_reasons.get(0) or next(iter(times.finish_reasons.values()), "stop")
        self.request_success[reason].inc()
        if metrics is not None:
            self.e2e_request_latency.observe(now - metrics.arrival_time)
        if times.num_generation_tokens > 1:
            self.time_per_output_token.observe(
                (times.last_token_time - times.first_token_time) / (times.num_generation_tokens - 1))
