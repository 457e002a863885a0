"""The executor of one process: the engine's own worker runs every step."""
import torch

from inferno.config import EngineConfig
from inferno.core.scheduler_output import DraftOutput, DraftRequest, ModelRunnerOutput, SchedulerOutput
from inferno.worker.calibration import calibrate_activations
from inferno.worker.input_batch import StepInput
from inferno.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.worker = Worker(config)
        self.model_runner = self.worker.model_runner
        # what the engine needs to know of the model: its files, shape, tokenizer and KV blocks
        self.model_path, self.model_config = self.worker.model_path, self.worker.model_config
        self.tokenizer, self.num_blocks = self.worker.tokenizer, self.worker.num_blocks
        self.kv_block_bytes = self.worker.kv_block_bytes
        self.kv_connector = self.worker.kv_connector  # disaggregated prefill/decode: None on a colocated instance

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(sched)

    def propose_drafts(self, wanted: list[DraftRequest]) -> DraftOutput:
        return self.worker.propose_drafts(wanted)

    def run_step(self, step: StepInput) -> torch.Tensor | None:
        return self.model_runner.run_step(step)

    def calibrate_activations(self, sequences: list[list[int]], smoothing: float | None) -> dict[str, torch.Tensor]:
        """Per decoder projection: its SmoothQuant factors (worker/calibration.py)."""
        return calibrate_activations(self.model_runner, sequences, smoothing)

    def is_healthy(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass
