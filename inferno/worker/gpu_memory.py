"""The KV cache's size on a GPU (vLLM's `gpu_memory_utilization`): the engine may use that fraction of the device's
memory; the weights, the peak activations of the largest step (measured by a profiling forward pass) and what
others hold (the CUDA context, other processes) come first, and the KV cache gets the rest."""
import logging

import torch

from inferno.core.kv_blocks import cdiv
from inferno.worker.input_batch import MicroBatch, StepInput

logger = logging.getLogger("inferno")
GIB = 1 << 30


def kv_cache_budget(total: int, used_by_others: int, peak_allocated: int, utilization: float) -> int:
    """Bytes left for the KV cache; a ValueError that says what does not fit when nothing is left."""
    budget = int(total * utilization) - used_by_others - peak_allocated
    if budget <= 0:
        raise ValueError(
            f"the model does not fit: gpu_memory_utilization={utilization} allows {total * utilization / GIB:.2f} "
            f"GiB of the GPU's {total / GIB:.2f} GiB, while the weights and the largest step's activations take "
            f"{peak_allocated / GIB:.2f} GiB and other users of the GPU hold {used_by_others / GIB:.2f} GiB; raise "
            f"gpu_memory_utilization, lower max_num_batched_tokens, or use a smaller or quantized model")
    return budget


def profile_step(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int,
                 block_size: int) -> tuple[StepInput, int]:
    """The largest step the scheduler can hand out (prefill tokens up to the budget, one logit row per sequence),
    and the KV blocks it needs."""
    tokens = min(max_num_batched_tokens, max_model_len)
    num_blocks = cdiv(tokens, block_size)
    rows = list(range(max(0, tokens - max_num_seqs), tokens))
    mb = MicroBatch([0] * tokens, list(range(tokens)), list(range(tokens)), decodes=[],
                    prefills=[(tokens, 0, list(range(num_blocks)))], logit_rows=rows)
    return StepInput([mb], []), num_blocks


def measure_peak_memory(run_profile, device: torch.device) -> tuple[int, int]:
    """(peak bytes allocated by torch while `run_profile()` runs, bytes of the GPU held outside torch's allocator
    before it), on `device`."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = (total - free) - torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    return peak, used_by_others
