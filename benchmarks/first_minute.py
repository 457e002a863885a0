"""The first minute of a server, timed from the command: one client sends greedy requests one after another (each
streamed, EOS ignored) from the moment `GET /health` answers 200, and records when every token arrives. The same
client and requests serve inferno and llama-server (both speak OpenAI's `/v1/completions`)."""
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from openai import OpenAI

HEALTH_POLL = 0.05  # seconds between health checks
START_TIMEOUT = 600  # seconds a server may take to answer /health


@dataclass(slots=True)
class FirstMinute:
    ready_s: float  # command -> /health 200
    first_token_s: float  # command -> the first streamed token of the first request
    tokens: float  # output tokens that arrived within the window
    window_s: float
    longest_gap_s: float  # the longest wait between two tokens of one request (a stalled step shows here)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s

    def __str__(self) -> str:
        return (f"healthy {self.ready_s:.2f} s, first token {self.first_token_s:.2f} s, {self.tokens_per_s:.1f} tok/s "
                f"over {self.window_s:.0f} s, longest gap {self.longest_gap_s:.2f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; its log ({log}) ends:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(HEALTH_POLL)
    raise TimeoutError(f"no healthy server on port {port} after {START_TIMEOUT} s; see {log}")


def stream_times(client: OpenAI, model: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival time of every streamed chunk that carries text (usually one token; see `tokens_before`)."""
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    return [time.monotonic() for chunk in stream if chunk.choices and chunk.choices[0].text]


def tokens_before(deadline: float, times: list[float], max_tokens: int) -> float:
    """A request's tokens that arrived before `deadline`: with EOS ignored it made exactly max_tokens, spread over
    its chunks (a server may hold a token back until the next completes a character, and send both at once)."""
    return max_tokens * sum(t < deadline for t in times) / len(times)


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def first_minute(command: list[str], port: int, prompts: list[str], max_tokens: int, window_s: float,
                 log: Path, env: dict[str, str] | None = None) -> FirstMinute:
    """Start `command` (a server on `port`), then send `prompts` in turn (cycling) until `window_s` seconds after
    the command (at least one); the request under way at the end finishes, and counts for its tokens that arrived
    in time."""
    with log.open("w") as out:
        start = time.monotonic()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        wait_healthy(process, port, log)
        ready = time.monotonic() - start
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        deadline, first, tokens, gap, i = start + window_s, None, 0.0, 0.0, 0
        while first is None or time.monotonic() < deadline:  # the first request even when the start was slower
            times = stream_times(client, model, prompts[i % len(prompts)], max_tokens)
            first = first or times[0]
            tokens += tokens_before(deadline, times, max_tokens)
            gap = max([gap, *(b - a for a, b in zip(times, times[1:]))])
            i += 1
        return FirstMinute(ready, first - start, tokens, window_s, gap)
    finally:
        stop(process)
