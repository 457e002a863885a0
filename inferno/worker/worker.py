"""One rank: loads (and quantizes) its shard of the model and owns its ModelRunner and KV cache shard."""
import torch.distributed as dist

from inferno.config import EngineConfig, ModelConfig
from inferno.core.scheduler_output import SchedulerOutput
from inferno.distributed.parallel_state import SINGLE, ParallelRank
from inferno.loader.model_loader import load_model, read_model_config
from inferno.worker.model_runner import ModelRunner, kv_bytes_per_block


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig) -> int:
    """Blocks in the KV cache pool, counted on the whole model's layers and heads: every rank holds the same block
    ids, each for its own layers (pipeline) or heads (tensor parallel). A speculative draft model's cache is
    addressed by the same block ids, so each block id costs the target's and the draft's bytes out of
    kv_cache_memory."""
    models = [model_config]
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        models.append(read_model_config(spec.model))
    block_bytes = sum(kv_bytes_per_block(m, config.block_size, config.torch_dtype, config.kv_cache_dtype)
                      for m in models)
    num_blocks = config.kv_cache_memory // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes is too small for one KV block")
    return num_blocks


class Worker:
    def __init__(self, config: EngineConfig, parallel: ParallelRank = SINGLE):
        loaded = load_model(config.model, config.torch_dtype, parallel, config.quantization,
                            config.quantization_group_size)
        self.model_path = loaded.path
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.num_blocks = num_kv_blocks(config, loaded.config)
        self.model_runner = ModelRunner(loaded.model, config, self.num_blocks, parallel)

    def serve(self, control_group: dist.ProcessGroup) -> None:
        """Ranks other than 0: run every step rank 0 broadcasts, until it broadcasts None (shutdown)."""
        while (message := self.model_runner.parallel.broadcast_object(None, control_group)) is not None:
            if isinstance(message, SchedulerOutput):
                self.model_runner.execute_model(message)
            else:  # a bare StepInput
                self.model_runner.run_step(message)
