"""`inferno train-draft-heads`: speculative heads distilled from the target itself. The engine continues the
prompts (batched), the executor records the target's hidden states over those sequences and trains the heads on
them, and the heads' folder is written where `speculative_config={"method": "medusa" | "eagle", "model": DIR}` loads
it."""
import json
from pathlib import Path

from inferno.core.head_training import HeadTrainingConfig, TrainingSequence
from inferno.loader.eagle_folder import EagleFolder, write_eagle_folder
from inferno.loader.medusa_folder import write_medusa_folder
from inferno.sampling_params import SamplingParams


def read_prompts(path: str | Path) -> list[dict]:
    """JSON lines, each {"prompt": "..."} or {"messages": [...]} (chat messages, rendered with the template)."""
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(entry, dict) or not (isinstance(entry.get("prompt"), str)
                                               or isinstance(entry.get("messages"), list)):
            raise ValueError(f"{path}:{number}: expected {{\"prompt\": \"...\"}} or {{\"messages\": [...]}}")
        prompts.append(entry)
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


def generate_sequences(llm, prompts: list[dict], params: SamplingParams) -> list[TrainingSequence]:
    """Each prompt with the target's continuation of it."""
    render = llm.llm_engine.input_processor.render_chat
    inputs = [render(p["messages"]) if "messages" in p else p["prompt"] for p in prompts]
    outputs = llm.generate(inputs, params)
    return [TrainingSequence(o.prompt_token_ids + list(o.outputs[0].token_ids), len(o.prompt_token_ids))
            for o in outputs]


def train_draft_heads(llm, prompts: list[dict], output: str | Path, config: HeadTrainingConfig,
                      params: SamplingParams) -> list[float]:
    """Writes the heads' folder to `output`; returns each head's top-1 accuracy on the held-out sequences."""
    sequences = generate_sequences(llm, prompts, params)
    # recording the hidden states writes the KV cache from block 0 on: no cached prefix may stay there
    llm.llm_engine.reset_prefix_cache()
    heads, accuracy = llm.llm_engine.executor.train_draft_heads(sequences, config)
    (write_eagle_folder if isinstance(heads, EagleFolder) else write_medusa_folder)(output, heads)
    return accuracy
