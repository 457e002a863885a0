"""The interface the engine steps the model through, whatever runs it (one process, or ranks over
torch.distributed), and what it tells the engine of the model."""
from abc import ABC, abstractmethod

import torch

from inferno.core.head_training import HeadTrainingConfig, TrainingSequence
from inferno.core.scheduler_output import DraftOutput, DraftRequest, ModelRunnerOutput, SchedulerOutput
from inferno.loader.eagle_folder import EagleFolder
from inferno.loader.medusa_folder import MedusaFolder
from inferno.lora_request import LoRARequest
from inferno.worker.input_batch import StepInput
from inferno.worker.worker import Worker


class Executor(ABC):
    def _expose(self, worker: Worker) -> None:
        """What the engine needs to know of the model: its files, shape, tokenizer and KV blocks (from rank 0's
        worker)."""
        self.worker = worker
        self.model_runner = worker.model_runner
        self.model_path, self.model_config = worker.model_path, worker.model_config
        self.tokenizer, self.num_blocks = worker.tokenizer, worker.num_blocks
        self.kv_block_bytes = worker.kv_block_bytes
        self.kv_connector = worker.kv_connector  # disaggregated prefill/decode: None on a colocated instance

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the scheduled step; the sampled output."""

    def propose_drafts(self, wanted: list[DraftRequest]) -> DraftOutput:
        """Rank 0 alone proposes (a draft model runs whole there)."""
        return self.worker.propose_drafts(wanted)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check a LoRA adapter against the model (ValueError if it does not fit); False if held already.
        LoRA runs on one rank (EngineConfig refuses it with several)."""
        return self.model_runner.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.model_runner.lora.remove(lora_int_id)

    @abstractmethod
    def run_step(self, step: StepInput) -> torch.Tensor | None:
        """Run the flat batches of `step` (no request states, no sampling); the logits."""

    @abstractmethod
    def calibrate_activations(self, sequences: list[list[int]], smoothing: float | None) -> dict[str, torch.Tensor]:
        """Per decoder projection: its SmoothQuant factors."""

    def train_draft_heads(self, sequences: list[TrainingSequence], config: HeadTrainingConfig
                          ) -> tuple[MedusaFolder | EagleFolder, list[float]]:
        """Speculative heads distilled from the model on `sequences`, and their held-out top-1 accuracy (Medusa: per
        head; EAGLE: per draft depth)."""
        raise ValueError("training draft heads runs on one process: use tensor_parallel_size and "
                         "pipeline_parallel_size 1")

    def wait_for_warm_up(self, timeout: float | None = None) -> bool:
        """Block until rank 0's background warm-ups (the compiled decode step, huge pages; a draft model's too) are
        over, at most `timeout` seconds; True if decode steps now run compiled."""
        return self.worker.wait_for_warm_up(timeout)

    @abstractmethod
    def is_healthy(self) -> bool:
        """False once the executor cannot run steps any more."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop whatever runs the steps; safe to call more than once."""
