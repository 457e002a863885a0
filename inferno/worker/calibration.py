"""Activation calibration on this rank's model: sample sequences run as prefills with an ActivationRecorder on
every decoder projection."""
import torch

from inferno.core.kv_blocks import cdiv
from inferno.layers.quantization.activation_calibration import ActivationRecorder
from inferno.layers.quantization.w8a8 import decoder_linears
from inferno.worker.input_batch import MicroBatch, StepInput
from inferno.worker.model_runner import ModelRunner


def prefill_step(sequences: list[list[int]], block_size: int) -> StepInput:
    """Sequences from position 0 as one batch of prefills, each in its own KV blocks (the first in 0, 1, …, so
    slot = position; the next in the blocks after), no logits; their rows one after the other. Calibration and
    head training run while no request holds blocks."""
    input_ids, positions, slots, prefills, first_block = [], [], [], [], 0
    for token_ids in sequences:
        n, blocks = len(token_ids), cdiv(len(token_ids), block_size)
        input_ids += token_ids
        positions += range(n)
        slots += range(first_block * block_size, first_block * block_size + n)
        prefills.append((n, 0, list(range(first_block, first_block + blocks))))
        first_block += blocks
    return StepInput([MicroBatch(input_ids, positions, slots, decodes=[], prefills=prefills, logit_rows=[])], [])


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
    steps = [prefill_step([ids], block_size) for ids in sequences]
    recorder = ActivationRecorder(linears)
    try:
        for step in steps:
            runner.run_step(step)
        return recorder.smoothing(smoothing)
    finally:
        recorder.remove()
