"""What `inferno train-draft-heads` asks the worker for: speculative heads distilled from the target itself."""
from dataclasses import dataclass


@dataclass(slots=True)
class HeadTrainingConfig:
    method: str = "medusa"  # "medusa" | "eagle"
    num_heads: int = 3  # Medusa: head j predicts the token j + 2 positions ahead (EAGLE: one head)
    num_layers: int = 1  # Medusa: residual blocks per head (EAGLE: one decoder layer)
    epochs: int = 4
    learning_rate: float | None = None  # None: 1e-3 for Medusa, 2e-4 for EAGLE (docs/speculative-decoding.md)
    batch_size: int = 256  # positions per optimizer step
    held_out_fraction: float = 0.1  # of the sequences (at least one), never trained on: the accuracy reported
    draft_vocab_size: int | None = 32768  # EAGLE: the head's LM head covers the most frequent tokens (None: all)
    seed: int = 0
    unroll_steps: int = 3  # EAGLE: draft steps unrolled in training, each after the first on the head's own output
    # (EAGLE-3's training-time test); 1: teacher forcing alone

    def __post_init__(self) -> None:
        if self.method not in ("medusa", "eagle"):
            raise ValueError(f"train-draft-heads trains method 'medusa' or 'eagle' heads, got {self.method!r}")
        for name in ("num_heads", "epochs", "batch_size", "unroll_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be at least 0, got {self.num_layers}")
        if self.learning_rate is None:
            self.learning_rate = 2e-4 if self.method == "eagle" else 1e-3
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be at least 1, got {self.draft_vocab_size}")
        if not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")


@dataclass(slots=True)
class TrainingSequence:
    token_ids: list[int]  # a prompt and the target's continuation of it (or a text: no continuation)
    num_prompt_tokens: int  # Medusa heads learn the continuation, from the prompt's last token on (EAGLE: all)
