"""Activation calibration on this rank's model: sample sequences run as prefills with an ActivationRecorder on
every decoder projection."""
import torch

from inferno.core.kv_blocks import cdiv
from inferno.layers.quantization.activation_calibration import ActivationRecorder
from inferno.layers.quantization.w8a8 import decoder_linears
from inferno.worker.input_batch import MicroBatch, StepInput
from inferno.worker.model_runner import ModelRunner


def prefill_step(token_ids: list[int], block_size: int) -> StepInput:
    """One sequence from position 0 in KV blocks 0, 1, … (so slot = position), no logits. Calibration runs while
    no request holds blocks."""
    n = len(token_ids)
    mb = MicroBatch(list(token_ids), list(range(n)), list(range(n)), decodes=[],
                    prefills=[(n, 0, list(range(cdiv(n, block_size))))], logit_rows=[])
    return StepInput([mb], [])


@torch.inference_mode()
def calibrate_activations(runner: ModelRunner, sequences: list[list[int]], smoothing: float | None
                          ) -> dict[str, torch.Tensor]:
    """Per decoder projection, by name, its SmoothQuant factors over the inputs of `sequences` (migration strength
    `smoothing`, or None: by projection type)."""
    linears = decoder_linears(runner.model)
    if not linears:
        raise ValueError("the model has no float projections to calibrate: load it with quantization=None "
                         "(`--quantization none`)")
    block_size, num_blocks = runner.block_size, runner.num_blocks
    longest = max(len(s) for s in sequences)
    if cdiv(longest, block_size) > num_blocks:
        raise ValueError(f"a calibration sequence of {longest} tokens does not fit the KV cache's {num_blocks} "
                         f"blocks of {block_size}")
    steps = [prefill_step(ids, block_size) for ids in sequences]
    recorder = ActivationRecorder(linears)
    try:
        for step in steps:
            runner.run_step(step)
        return recorder.smoothing(smoothing)
    finally:
        recorder.remove()
