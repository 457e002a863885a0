"""The executor of one process: the engine's own worker runs every step."""
import torch

from inferno.config import EngineConfig
from inferno.core.head_training import HeadTrainingConfig, TrainingSequence
from inferno.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from inferno.executor.abstract import Executor
from inferno.worker.calibration import calibrate_activations
from inferno.loader.eagle_folder import EagleFolder
from inferno.loader.medusa_folder import MedusaFolder
from inferno.worker.input_batch import StepInput
from inferno.worker.spec_decode.eagle_training import train_eagle_head
from inferno.worker.spec_decode.head_training import train_medusa_heads
from inferno.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self._expose(Worker(config))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(sched)

    def run_step(self, step: StepInput) -> torch.Tensor | None:
        return self.model_runner.run_step(step)

    def calibrate_activations(self, sequences: list[list[int]], smoothing: float | None) -> dict[str, torch.Tensor]:
        return calibrate_activations(self.model_runner, sequences, smoothing)

    def train_draft_heads(self, sequences: list[TrainingSequence], config: HeadTrainingConfig
                          ) -> tuple[MedusaFolder | EagleFolder, list[float]]:
        train = train_eagle_head if config.method == "eagle" else train_medusa_heads
        return train(self.model_runner, sequences, config, self.model_path)

    def is_healthy(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass
