"""One rank: loads (and quantizes) its shard of the model and owns its ModelRunner and KV cache shard."""
import dataclasses
import logging
import time

import torch
import torch.distributed as dist

from inferno.config import EngineConfig, ModelConfig
from inferno.core.scheduler_output import DraftOutput, DraftRequest, SchedulerOutput
from inferno.distributed.parallel_state import SINGLE, ParallelRank
from inferno.core.kv_blocks import cdiv
from inferno.loader.model_loader import load_model, read_model_config
from inferno.worker.gpu_memory import GIB, kv_cache_budget, measure_peak_memory, profile_step
from inferno.worker.kv_cache import auto_num_blocks
from inferno.worker.kv_connector import KVConnector
from inferno.worker.model_runner import ModelRunner, kv_bytes_per_block
from inferno.worker.spec_decode.draft_model import DraftModelProposer, load_draft_model
from inferno.worker.spec_decode.drafting_request import DraftingRequest
from inferno.worker.spec_decode.eagle import EagleProposer, head_dtype, head_kv_bytes_per_block, load_eagle_head
from inferno.worker.spec_decode.medusa import MedusaProposer, load_medusa_heads
from inferno.worker.spec_decode.ngram import NgramProposer
from inferno.worker.warm_up import import_compiler_early

logger = logging.getLogger("inferno")


def kv_block_bytes(config: EngineConfig, model_config: ModelConfig, eagle_head: ModelConfig | None = None) -> int:
    """Bytes of one block id, counted on the whole model's layers and heads: every rank holds the same block ids,
    each for its own layers (pipeline) or heads (tensor parallel). A speculative draft model's (or EAGLE head's)
    cache is addressed by the same block ids, so each block id costs the target's and the draft's bytes."""
    models = [model_config]
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        models.append(read_model_config(spec.model))
    head_bytes = 0 if eagle_head is None else head_kv_bytes_per_block(
        eagle_head, config.block_size, head_dtype(config.torch_dtype, torch.device(config.device)))
    return head_bytes + sum(kv_bytes_per_block(m, config.block_size, config.kv_cache_dtype) for m in models)


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, block_bytes: int) -> int:
    """Blocks in the KV cache pool: `kv_cache_memory` bytes' worth, or by default as many as the available memory
    allows (see kv_cache.auto_num_blocks), up to `max_num_seqs` sequences of max_model_len tokens."""
    if config.kv_cache_memory is not None:
        num_blocks = config.kv_cache_memory // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes is too small for one KV block "
                             f"({block_bytes} bytes)")
        return num_blocks
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    num_blocks = auto_num_blocks(block_bytes, config.max_num_seqs * cdiv(max_model_len, config.block_size))
    if num_blocks < 1:
        raise ValueError(f"too little memory is available for one KV block ({block_bytes} bytes); free some memory "
                         f"or set kv_cache_memory")
    return num_blocks


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """CUDA: one GPU per rank (rank i on GPU i of its machine); else the CPU."""
    if config.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


class Worker:
    def __init__(self, config: EngineConfig, parallel: ParallelRank = SINGLE):
        self.device = rank_device(config, parallel.rank)
        quantization = config.quantization
        if self.device.type == "cuda" and quantization == "auto":
            # the int4/int8 kernels are the CPU's: on a GPU a GGUF file's quantized blocks become the model dtype
            quantization = None
        if self.device.type == "cpu" and not config.enforce_eager and parallel.world_size == 1 and \
                config.runner != "pooling":
            import_compiler_early()  # the warm-up will compile the decode step (or load it precompiled)
        loaded = load_model(config.model, config.torch_dtype, parallel, quantization, config.quantization_group_size,
                            config.calibration)
        self.model_path = loaded.path
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        spec = config.speculative_config
        # rank 0 drafts: an EAGLE head, or a draft model (loaded before a GPU's KV cache is sized from the memory left)
        eagle = (load_eagle_head(spec.model, loaded.config, config.torch_dtype, self.device)
                 if parallel.rank == 0 and spec is not None and spec.method == "eagle" else None)
        self.kv_block_bytes = kv_block_bytes(config, loaded.config, None if eagle is None else eagle.config)
        if self.device.type == "cuda":
            loaded.model.to_device(self.device)
        draft = (load_draft_model(spec, config, loaded.config, quantization, self.device)
                 if parallel.rank == 0 and spec is not None and spec.method == "draft_model" else None)
        if self.device.type == "cuda":
            self.num_blocks = self._gpu_num_blocks(config, loaded.model, parallel)
        else:
            self.num_blocks = num_kv_blocks(config, loaded.config, self.kv_block_bytes)
        if config.kv_cache_memory is None and parallel.world_size > 1:  # every rank must hold the same block ids
            count = torch.tensor([self.num_blocks], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            self.num_blocks = int(count)
        self.model_runner = ModelRunner(loaded.model, config, self.num_blocks, parallel, self.device)
        if spec is not None and spec.speculative_token_tree is not None:
            self.model_runner.check_trees_supported(spec.tree_width)
        self.kv_connector = None if config.kv_role is None else KVConnector(
            self.model_runner.kv_caches(), config.kv_role, config.kv_host, config.kv_port,
            config.kv_transfer_backend, config.kv_transfer_timeout)
        self.proposer = None  # rank 0, which samples, proposes the drafts
        if draft is not None:
            self.proposer = DraftModelProposer(draft, config, self.num_blocks, self.model_runner.requests, self.device)
        elif eagle is not None:
            self.proposer = EagleProposer(eagle, self.model_runner, config)
        elif parallel.rank == 0 and spec is not None and spec.method == "medusa":
            heads = load_medusa_heads(spec.model, loaded.config, config.torch_dtype, self.device)
            self.proposer = MedusaProposer(heads, self.model_runner, spec.speculative_token_tree)
        elif parallel.rank == 0 and spec is not None:
            self.proposer = NgramProposer(spec)

    def wait_for_warm_up(self, timeout: float | None = None) -> bool:
        """Block until this rank's warm-ups are over, its runner's and a draft model's runner's (at most `timeout`
        seconds in all); True if its decode steps now run compiled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        compiled = self.model_runner.wait_for_warm_up(timeout)
        draft = getattr(self.proposer, "runner", None)  # Medusa's and EAGLE's are the target's own
        if draft is not None and draft is not self.model_runner:
            draft.wait_for_warm_up(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return compiled

    def propose_drafts(self, wanted: list[DraftRequest]) -> DraftOutput:
        """Rank 0: drafts for the requests the speculation policy asked, after their step."""
        states = self.model_runner.requests
        return self.proposer.propose([DraftingRequest.of(states[w.req_id], w) for w in wanted])

    def _gpu_num_blocks(self, config: EngineConfig, model, parallel: ParallelRank) -> int:
        """`kv_cache_memory` bytes' worth, or what gpu_memory_utilization leaves after a profiling step."""
        if config.kv_cache_memory is not None:
            return num_kv_blocks(config, self.model_config, self.kv_block_bytes)
        max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        step, blocks = profile_step(config.max_num_batched_tokens, max_model_len, config.max_num_seqs,
                                    config.block_size)
        runner = ModelRunner(model, dataclasses.replace(config, enforce_eager=True), blocks, parallel, self.device)
        peak, others = measure_peak_memory(lambda: runner.run_step(step), self.device)
        for attn in model.attention_layers:  # the profiling cache goes (its bytes counted in the peak: a margin)
            attn.k_cache = attn.v_cache = attn.k_scale = attn.v_scale = None
        del runner
        torch.cuda.empty_cache()
        budget = kv_cache_budget(torch.cuda.mem_get_info(self.device)[1], others, peak,
                                 config.gpu_memory_utilization)
        useful = config.max_num_seqs * cdiv(max_model_len, config.block_size)
        num_blocks = min(budget // self.kv_block_bytes, useful)
        logger.info("GPU memory: weights and peak activations %.2f GiB, KV cache %.2f GiB (%d blocks)", peak / GIB,
                    num_blocks * self.kv_block_bytes / GIB, num_blocks)
        return num_blocks

    def serve(self, control_group: dist.ProcessGroup) -> None:
        """Ranks other than 0: run every step rank 0 broadcasts, until it broadcasts None (shutdown)."""
        while (message := self.model_runner.parallel.broadcast_object(None, control_group)) is not None:
            if isinstance(message, SchedulerOutput):
                self.model_runner.execute_model(message)
            else:  # a bare StepInput
                self.model_runner.run_step(message)
