"""One rank: loads (and quantizes) its shard of the model and owns its ModelRunner and KV cache shard."""
import torch
import torch.distributed as dist

from inferno.config import EngineConfig, ModelConfig
from inferno.core.scheduler_output import SchedulerOutput
from inferno.distributed.parallel_state import SINGLE, ParallelRank
from inferno.core.kv_blocks import cdiv
from inferno.loader.model_loader import load_model, read_model_config
from inferno.worker.kv_cache import auto_num_blocks
from inferno.worker.model_runner import ModelRunner, kv_bytes_per_block


def kv_block_bytes(config: EngineConfig, model_config: ModelConfig) -> int:
    """Bytes of one block id, counted on the whole model's layers and heads: every rank holds the same block ids,
    each for its own layers (pipeline) or heads (tensor parallel). A speculative draft model's cache is addressed
    by the same block ids, so each block id costs the target's and the draft's bytes."""
    models = [model_config]
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        models.append(read_model_config(spec.model))
    return sum(kv_bytes_per_block(m, config.block_size, config.torch_dtype, config.kv_cache_dtype) for m in models)


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


class Worker:
    def __init__(self, config: EngineConfig, parallel: ParallelRank = SINGLE):
        loaded = load_model(config.model, config.torch_dtype, parallel, config.quantization,
                            config.quantization_group_size, config.calibration)
        self.model_path = loaded.path
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.kv_block_bytes = kv_block_bytes(config, loaded.config)
        self.num_blocks = num_kv_blocks(config, loaded.config, self.kv_block_bytes)
        if config.kv_cache_memory is None and parallel.world_size > 1:  # every rank must hold the same block ids
            count = torch.tensor([self.num_blocks])
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            self.num_blocks = int(count)
        self.model_runner = ModelRunner(loaded.model, config, self.num_blocks, parallel)

    def serve(self, control_group: dist.ProcessGroup) -> None:
        """Ranks other than 0: run every step rank 0 broadcasts, until it broadcasts None (shutdown)."""
        while (message := self.model_runner.parallel.broadcast_object(None, control_group)) is not None:
            if isinstance(message, SchedulerOutput):
                self.model_runner.execute_model(message)
            else:  # a bare StepInput
                self.model_runner.run_step(message)
