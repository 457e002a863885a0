"""llama.cpp's own tools as a benchmark peer: llama-bench, llama-batched-bench and llama-server on one GGUF file with
a fixed thread count (the binaries come from build_llamacpp.py)."""
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

TIMEOUT = 3600  # seconds one tool run may take (Qwen 1.5B at B=64 takes minutes on 2 cores)


@dataclass(slots=True)
class LlamaCpp:
    tools: dict[str, Path]
    model: str
    threads: int

    def run(self, tool: str, *args: str) -> str:
        """The tool's stdout, where both benchmark tools print their results (their logs go to stderr)."""
        cmd = [str(self.tools[tool]), "-m", self.model, *args]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
        if result.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        return result.stdout

    def bench(self, prompt_len: int, output_len: int) -> tuple[float, float]:
        """llama-bench's pp<prompt_len> and tg<output_len> tok/s, one repetition each (after its own warm-up run)."""
        out = self.run("llama-bench", "-t", str(self.threads), "-p", str(prompt_len), "-n", str(output_len),
                       "-r", "1", "-o", "json")
        tests = json.loads(out[out.index("["):out.rindex("]") + 1])
        pp = next(t["avg_ts"] for t in tests if t["n_prompt"] == prompt_len and t["n_gen"] == 0)
        tg = next(t["avg_ts"] for t in tests if t["n_gen"] == output_len and t["n_prompt"] == 0)
        return pp, tg

    def batched_bench(self, prompt_len: int, output_len: int, batch_sizes: list[int]) -> dict[int, float]:
        """llama-batched-bench: B sequences of their own prompt_len-token prompt and output_len new tokens each,
        total (prompt + generated) tok/s per B."""
        context = max(batch_sizes) * (prompt_len + output_len) + 256
        out = self.run("llama-batched-bench", "-t", str(self.threads), "-tb", str(self.threads),
                       "-c", str(context), "-npp", str(prompt_len), "-ntg", str(output_len),
                       "-npl", ",".join(map(str, batch_sizes)), "--output-format", "jsonl")
        rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"n_kv_max"')]
        return {row["pl"]: row["speed"] for row in rows}

    def server_command(self, port: int, context: int = 4096) -> list[str]:
        """llama-server serving one request at a time (-np 1), as a user starts it."""
        return [str(self.tools["llama-server"]), "-m", self.model, "-t", str(self.threads), "-tb", str(self.threads),
                "-c", str(context), "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
