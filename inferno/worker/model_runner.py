"""Runs one scheduled step: flat input tensors from the schedule, one forward pass, sampling."""
from dataclasses import dataclass

import torch

from inferno.config import EngineConfig, ModelConfig
from inferno.engine.kv_cache_manager import cdiv
from inferno.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from inferno.kernels import paged_attention
from inferno.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk, block_rows
from inferno.layers.rejection_sampler import Drafts, rejection_sample
from inferno.layers.sampler import Sampler, SamplingMetadata, gather_logprobs
from inferno.model.llama import LlamaForCausalLM
from inferno.request import Request
from inferno.worker.cpu_malloc import keep_freed_memory


DECODE_GROUP_SIZE = 32  # PyTorch path: decodes sorted by length are attended in groups padded to their longest
MAX_DECODE_ROWS_PER_CHUNK = 16  # chunks over cached context up to this long attend as decode rows


@dataclass(slots=True)
class TokenChunk:
    """Tokens of one sequence to run: `token_ids` at positions start.. (start = tokens already in the cache)."""
    token_ids: list[int]
    start: int
    block_ids: list[int]


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, engine_config: EngineConfig, num_blocks: int):
        self.model = model
        self.config = model.config
        self.block_size = engine_config.block_size
        self.num_blocks = num_blocks
        self.use_kernels = paged_attention() is not None
        self.dtype = engine_config.torch_dtype
        self.sampler = Sampler()
        keep_freed_memory()
        shape = (self.config.num_key_value_heads, num_blocks, self.block_size, self.config.head_dim)
        # zeros, not empty: masked-out slots are still multiplied by zero weights, and stale NaN/inf garbage would
        # turn that into NaN
        for attn in model.attention_layers:
            attn.k_cache = torch.zeros(shape, dtype=self.dtype)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        chunks = []
        for req, n in zip(sched.requests, sched.num_scheduled_tokens):
            drafts = sched.spec_token_ids.get(req.request_id, [])
            c = req.num_computed_tokens
            chunks.append(TokenChunk(req.token_ids[c:c + n - len(drafts)] + drafts, c, req.block_ids))
        hidden, offsets = self.forward(chunks)

        out = ModelRunnerOutput(sampled_token_ids={})
        sample_rows: list[int] = []  # flat index of the last token of each request that samples
        sample_requests: list[Request] = []
        spec_requests: list[Request] = []
        for req, n, start in zip(sched.requests, sched.num_scheduled_tokens, offsets):
            if req.request_id in sched.spec_token_ids:
                spec_requests.append(req)
            elif req.num_computed_tokens + n == req.num_tokens:
                sample_rows.append(start + n - 1)
                sample_requests.append(req)
        if sample_requests:
            logits = self.model.compute_logits(hidden[sample_rows])
            result = self.sampler(logits, sampling_metadata([(r, []) for r in sample_requests], self.config.vocab_size))
            sampled = result.sampled_token_ids.tolist()
            for i, req in enumerate(sample_requests):
                out.sampled_token_ids[req.request_id] = [sampled[i]]
            if result.logprobs is not None:
                ids, values, ranks = result.logprob_token_ids.tolist(), result.logprobs.tolist(), result.sampled_ranks.tolist()
                for i, req in enumerate(sample_requests):
                    if req.sampling_params.logprobs is not None:
                        k = 1 + req.sampling_params.logprobs
                        out.logprobs[req.request_id] = (ids[i][:k], values[i][:k], ranks[i])
        if spec_requests:
            self._verify_drafts(hidden, offsets, sched, spec_requests, out)
        self._prompt_logprobs(hidden, offsets, sched, out)
        return out

    def _verify_drafts(self, hidden: torch.Tensor, offsets: list[int], sched: SchedulerOutput,
                       spec_requests: list[Request], out: ModelRunnerOutput) -> None:
        """Target logits at all 1 + k positions of each speculating request -> rejection sampling."""
        offset_of = {req.request_id: start for req, start in zip(sched.requests, offsets)}
        rows, metadata_rows, drafts = [], [], []
        for req in spec_requests:
            tokens = sched.spec_token_ids[req.request_id]
            start = offset_of[req.request_id]
            rows.extend(range(start, start + len(tokens) + 1))
            metadata_rows.extend((req, tokens[:j]) for j in range(len(tokens) + 1))
            probs = None if req.draft_probs is None else req.draft_probs[:len(tokens)]
            drafts.append(Drafts(tokens, probs, req.generator))
        logits = self.model.compute_logits(hidden[rows])
        emitted = rejection_sample(logits, sampling_metadata(metadata_rows, self.config.vocab_size), drafts)
        for req, tokens in zip(spec_requests, emitted):
            out.sampled_token_ids[req.request_id] = tokens

    def _prompt_logprobs(self, hidden: torch.Tensor, offsets: list[int], sched: SchedulerOutput,
                         out: ModelRunnerOutput) -> None:
        for req, n, start in zip(sched.requests, sched.num_scheduled_tokens, offsets):
            if req.sampling_params.prompt_logprobs is None:
                continue
            c = req.num_computed_tokens
            # the logits at prompt position p score prompt token p + 1
            targets = [p for p in range(c, c + n) if p + 1 < req.num_prompt_tokens and p + 1 >= len(req.prompt_logprobs)]
            if not targets:
                continue
            logprobs = self.model.compute_logits(hidden[[start + p - c for p in targets]]).log_softmax(dim=-1)
            result = gather_logprobs(logprobs, torch.tensor([req.token_ids[p + 1] for p in targets]),
                                     req.sampling_params.prompt_logprobs)
            out.prompt_logprobs[req.request_id] = list(zip(
                result.logprob_token_ids.tolist(), result.logprobs.tolist(), result.sampled_ranks.tolist()))

    def forward(self, chunks: list[TokenChunk]) -> tuple[torch.Tensor, list[int]]:
        """One forward pass over the tokens of all chunks; returns hidden states [T, hidden] and where each chunk
        starts in that flat batch."""
        input_ids, positions, slot_mapping = [], [], []
        offsets = [0] * len(chunks)
        decodes: list[tuple[list[int], int]] = []  # (block ids, sequence length) of each decode row
        prefills: list[PrefillChunk] = []
        # decode rows first, shortest first (so each attention group pads little), then prefill chunks
        for i in sorted(range(len(chunks)), key=lambda i: (not self._as_decode_rows(chunks[i]), chunks[i].start)):
            chunk = chunks[i]
            start, n, c = len(input_ids), len(chunk.token_ids), chunk.start
            offsets[i] = start
            input_ids.extend(chunk.token_ids)
            positions.extend(range(c, c + n))
            table = chunk.block_ids
            slot_mapping.extend(table[p // self.block_size] * self.block_size + p % self.block_size
                                for p in range(c, c + n))
            if self._as_decode_rows(chunk):
                assert not prefills, "decodes must come before prefill chunks"
                decodes.extend((table, p + 1) for p in range(c, c + n))
            else:
                prefills.append(self._prefill_chunk(start, n, c, table))
        group_size = max(len(decodes), 1) if self.use_kernels else DECODE_GROUP_SIZE
        groups = [self._decode_group(i, decodes[i:i + group_size]) for i in range(0, len(decodes), group_size)]
        meta = AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long), groups, prefills)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta)
        return hidden, offsets

    def _rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        return block_rows(block_ids, self.config.num_key_value_heads, self.num_blocks)

    def _prefill_chunk(self, start: int, n: int, num_computed: int, block_ids: list[int]) -> PrefillChunk:
        table = torch.tensor(block_ids[:cdiv(num_computed + n, self.block_size)], dtype=torch.long)
        mask = None
        if num_computed:
            keys = torch.arange(len(table) * self.block_size)
            queries = torch.arange(num_computed, num_computed + n)
            mask = keys.unsqueeze(0) <= queries.unsqueeze(1)
        return PrefillChunk(start, start + n, num_computed, self._rows(table), mask)

    @staticmethod
    def _as_decode_rows(chunk: TokenChunk) -> bool:
        """A decode, or a few tokens over cached context (a decode with drafts to verify, the tail of a chunked
        prefill): one decode row per token, each attending up to its own position, all in one batched call."""
        n = len(chunk.token_ids)
        return n == 1 or (chunk.start > 0 and n <= MAX_DECODE_ROWS_PER_CHUNK)

    def _decode_group(self, start: int, rows: list[tuple[list[int], int]]) -> DecodeGroup:
        """Block tables padded to the group's longest sequence (with block 0, masked out) and sequence lengths."""
        seq_lens = torch.tensor([seq_len for _, seq_len in rows])
        width = max(cdiv(seq_len, self.block_size) for _, seq_len in rows)
        tables = torch.tensor([table[:width] + [0] * (width - min(width, len(table))) for table, _ in rows],
                              dtype=torch.long)
        group = DecodeGroup(start, start + len(rows), tables, seq_lens)
        if not self.use_kernels:
            group.block_rows = self._rows(tables)
            group.mask = (torch.arange(width * self.block_size).unsqueeze(0) < seq_lens.unsqueeze(1))[None, :, None, :]
        return group


def sampling_metadata(rows: list[tuple[Request, list[int]]], vocab_size: int) -> SamplingMetadata:
    """One row per (request, draft tokens before the position): penalties and min_tokens see the output so far
    plus those drafts."""
    requests = [r for r, _ in rows]
    params = [r.sampling_params for r in requests]
    temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params])
    penalty_rows = [i for i, p in enumerate(params)
                    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty]
    banned = {}
    for i, (r, drafts) in enumerate(rows):
        if r.num_output_tokens + len(drafts) < r.sampling_params.min_tokens:
            banned[i] = sorted(r.eos_token_ids | set(r.sampling_params.stop_token_ids))
    wanted = [p.logprobs for p in params if p.logprobs is not None]

    def column(name: str, off, dtype) -> torch.Tensor | None:
        values = [getattr(p, name) for p in params]
        if name == "top_k":
            values = [min(k, vocab_size) for k in values]
        return None if all(v == off for v in values) else torch.tensor(values, dtype=dtype)

    def penalty(name: str) -> torch.Tensor | None:
        return torch.tensor([getattr(params[i], name) for i in penalty_rows]) if penalty_rows else None

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
    )
