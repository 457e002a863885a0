"""Training prompts for `inferno train-draft-heads`, disjoint from benchmarks/spec_decode.py's tasks: code-editing
asks over inferno's own Python files (every one but the benchmark's inferno/engine/block_pool.py) and open chat
questions other than the benchmark's. Writes JSON lines of chat messages.

    python benchmarks/draft_head_prompts.py --output /tmp/heads-prompts.jsonl --num-files 24
    inferno train-draft-heads models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --method medusa \\
        --prompts /tmp/heads-prompts.jsonl --output /tmp/qwen-1.5b-medusa --max-tokens 256
    python benchmarks/spec_decode.py --target models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --heads /tmp/qwen-1.5b-medusa --skip-default-model
(the same with --method eagle for an EAGLE head: --output /tmp/qwen-1.5b-eagle, then --method eagle --heads ...)
"""
import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT_FILE = ROOT / "inferno" / "engine" / "block_pool.py"  # the benchmark's grounded task
ASKS = ["Add a short docstring to every function of this Python file and return the whole file.",
        "Rename the first function's arguments to longer, clearer names and return the whole file.",
        "Add type hints wherever they are missing in this Python file and return the whole file.",
        "Sort the imports of this Python file alphabetically and return the whole file."]
QUESTIONS = ["Why do leaves change colour in autumn?", "How does a refrigerator keep food cold?",
             "Write a short poem about the sea.", "What are the main causes of inflation?",
             "Explain recursion to a beginner programmer.", "Suggest a plan for learning a new language.",
             "What makes a good unit test?", "Summarise the plot of a classic fairy tale.",
             "How do vaccines train the immune system?", "What is the difference between TCP and UDP?",
             "Give advice for a first job interview.", "Why is the ocean salty?",
             "How do airplanes stay in the air?", "Write a haiku about a rainy morning.",
             "What is a hash table and when would you use one?", "Explain how compound interest works.",
             "Describe the water cycle for a child.", "What are the pros and cons of remote work?",
             "How does a search engine rank web pages?", "Give me a recipe for a simple tomato soup.",
             "What is the difference between weather and climate?", "Explain what an API is to a non-programmer.",
             "Write a short story about a robot who learns to paint.", "How do I stay focused while studying?",
             "What causes earthquakes?", "Compare Python and JavaScript for a beginner.",
             "What does a database index do?", "How do plants make their food?",
             "Write a polite email asking for a deadline extension.", "Why do we dream?",
             "Explain Big O notation with examples.", "What are good habits for getting better sleep?",
             "How does public-key cryptography work?", "Summarise the causes of the First World War.",
             "What is machine learning, in simple terms?", "Give tips for writing a clear commit message.",
             "How does the heart pump blood?", "What is the difference between a process and a thread?",
             "Suggest five names for a coffee shop and explain each.", "Why is exercise good for the brain?",
             "Explain how Git branches work.", "What should I pack for a weekend hiking trip?",
             "How do solar panels produce electricity?", "What is the role of a compiler?",
             "Describe the life cycle of a butterfly.", "What are microservices, and when are they a bad idea?",
             "How can I make my code easier to test?", "Explain the difference between RAM and storage."]
MAX_FILE_CHARS = 6000  # a prompt of at most ~2k tokens


def prompts(num_files: int) -> list[dict]:
    files = [p for p in sorted((ROOT / "inferno").rglob("*.py"))
             if p != HELD_OUT_FILE and 500 < len(p.read_text()) <= MAX_FILE_CHARS][:num_files]
    edits = [{"messages": [{"role": "user", "content": f"{ASKS[i % len(ASKS)]}\n\n```python\n{p.read_text()}```"}]}
             for i, p in enumerate(files)]
    return edits + [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True)
    parser.add_argument("--num-files", type=int, default=24, help="code-editing prompts (one per file)")
    args = parser.parse_args()
    lines = prompts(args.num_files)
    Path(args.output).write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {len(lines)} prompts to {args.output}")


if __name__ == "__main__":
    main()
