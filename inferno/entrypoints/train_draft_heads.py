"""`inferno train-draft-heads`: speculative heads distilled from the target itself. The engine continues the
prompts (batched), the executor records the target's hidden states over those sequences and trains the heads on
them, and the heads' folder is written where `speculative_config={"method": "medusa" | "eagle", "model": DIR}` loads
it."""
import json
from collections.abc import Iterator
from pathlib import Path

from inferno.core.head_training import HeadTrainingConfig, TrainingSequence
from inferno.loader.eagle_folder import EagleFolder, write_eagle_folder
from inferno.loader.medusa_folder import write_medusa_folder
from inferno.sampling_params import SamplingParams


def json_lines(path: str | Path) -> Iterator[tuple[int, object]]:
    """Each non-blank line of `path` parsed as JSON, with its line number (a line that is not JSON: ValueError)."""
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None


def read_prompts(path: str | Path) -> list[dict]:
    """JSON lines, each {"prompt": "..."} or {"messages": [...]} (chat messages, rendered with the template)."""
    prompts = []
    for number, entry in json_lines(path):
        if not isinstance(entry, dict) or not (isinstance(entry.get("prompt"), str)
                                               or isinstance(entry.get("messages"), list)):
            raise ValueError(f"{path}:{number}: expected {{\"prompt\": \"...\"}} or {{\"messages\": [...]}}")
        prompts.append(entry)
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


def read_texts(path: str | Path, tokenizer, chunk_tokens: int) -> list[TrainingSequence]:
    """JSON lines, each {"text": "..."} (a user's own corpus: code, chat logs), tokenized and cut into sequences of
    `chunk_tokens` tokens (a last piece under 16 tokens dropped); no continuation is generated: an EAGLE head learns
    the target's own distributions at every position of them."""
    sequences = []
    for number, entry in json_lines(path):
        if not isinstance(entry, dict) or not isinstance(entry.get("text"), str):
            raise ValueError(f"{path}:{number}: expected {{\"text\": \"...\"}}")
        ids = tokenizer.encode(entry["text"])
        sequences += [TrainingSequence(ids[start:start + chunk_tokens], 1) for start in range(0, len(ids), chunk_tokens)
                      if len(ids) - start >= min(16, len(ids))]
    if not sequences:
        raise ValueError(f"{path} has no texts")
    return sequences


def generate_sequences(llm, prompts: list[dict], params: SamplingParams) -> list[TrainingSequence]:
    """Each prompt with the target's continuation of it."""
    render = llm.llm_engine.input_processor.render_chat
    inputs = [render(p["messages"]) if "messages" in p else p["prompt"] for p in prompts]
    outputs = llm.generate(inputs, params)
    return [TrainingSequence(o.prompt_token_ids + list(o.outputs[0].token_ids), len(o.prompt_token_ids))
            for o in outputs]


def write_sequences(path: str | Path, sequences: list[TrainingSequence]) -> None:
    """JSON lines, each {"token_ids": [...], "num_prompt_tokens": n}: what `read_sequences` reads back."""
    Path(path).write_text("".join(json.dumps({"token_ids": s.token_ids, "num_prompt_tokens": s.num_prompt_tokens})
                                  + "\n" for s in sequences), encoding="utf-8")


def read_sequences(path: str | Path, vocab_size: int) -> list[TrainingSequence]:
    """Sequences written by `write_sequences` (by this model, or one sharing its tokenizer)."""
    sequences = []
    for number, entry in json_lines(path):
        try:
            sequence = TrainingSequence([int(t) for t in entry["token_ids"]], int(entry["num_prompt_tokens"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}:{number}: expected {{\"token_ids\": [...], \"num_prompt_tokens\": n}}") from None
        if not all(0 <= t < vocab_size for t in sequence.token_ids):
            raise ValueError(f"{path}:{number}: a token id outside the model's vocabulary of {vocab_size}")
        if not 0 < sequence.num_prompt_tokens <= len(sequence.token_ids):
            raise ValueError(f"{path}:{number}: num_prompt_tokens must be in 1..{len(sequence.token_ids)}")
        sequences.append(sequence)
    if not sequences:
        raise ValueError(f"{path} has no sequences")
    return sequences


def train_draft_heads(llm, prompts: list[dict] | None, output: str | Path, config: HeadTrainingConfig,
                      params: SamplingParams, sequences: list[TrainingSequence] | None = None,
                      save_sequences: str | Path | None = None) -> list[float]:
    """Writes the heads' folder to `output`; returns the held-out top-1 accuracy (Medusa: per head; EAGLE: per draft
    depth). The training sequences are the target's continuations of `prompts` (if any) and `sequences` as given
    (texts, saved sequences); `save_sequences` keeps them all as JSON lines for another run."""
    sequences = (generate_sequences(llm, prompts, params) if prompts else []) + list(sequences or [])
    if save_sequences is not None:
        write_sequences(save_sequences, sequences)
    # recording the hidden states writes the KV cache from block 0 on: no cached prefix may stay there
    llm.llm_engine.reset_prefix_cache()
    heads, accuracy = llm.llm_engine.executor.train_draft_heads(sequences, config)
    (write_eagle_folder if isinstance(heads, EagleFolder) else write_medusa_folder)(output, heads)
    return accuracy
