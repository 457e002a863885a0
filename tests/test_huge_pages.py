"""Weights swapped onto transparent huge pages in place: same addresses, same bytes (also for a reader running
during the swap), only the pages nothing else writes; an engine's warm-up swaps its weights without changing a token."""
import mmap
import sys
import threading

import numpy as np
import pytest
import torch
from torch import nn

from conftest import assert_all_blocks_free
from inferno import LLM, SamplingParams
from inferno.worker import warm_up
from inferno.worker.huge_pages import (HUGE_PAGE, Mapping, huge_page_size, move_weights_to_huge_pages,
                                       movable_ranges, read_mappings, weight_ranges)
from tiny_gguf import T, write_tiny_gguf

MIB = 1 << 20
linux_thp = pytest.mark.skipif(sys.platform != "linux" or huge_page_size() != HUGE_PAGE,
                               reason="transparent huge pages of 2 MiB are a Linux feature, here off or of another size")


def test_movable_ranges_round_out_in_file_maps_in_anonymous_memory_and_skip_shared_ones():
    base = 64 * HUGE_PAGE
    file_map = Mapping(base + MIB, base + 9 * HUGE_PAGE + MIB, shared=False, file=True, huge_advised=False)
    heap = Mapping(base + 20 * HUGE_PAGE, base + 40 * HUGE_PAGE, shared=False, file=False, huge_advised=False)
    advised = Mapping(base + 50 * HUGE_PAGE, base + 60 * HUGE_PAGE, shared=False, file=False, huge_advised=True)
    shared = Mapping(base + 70 * HUGE_PAGE, base + 80 * HUGE_PAGE, shared=True, file=True, huge_advised=False)
    weights = [(base + 3 * HUGE_PAGE + 5, base + 4 * HUGE_PAGE + 7),  # file: its huge pages, rounded out
               (base + 8 * HUGE_PAGE, base + 9 * HUGE_PAGE + MIB),  # file: up to the mapping's last whole page
               (base + 21 * HUGE_PAGE + 5, base + 24 * HUGE_PAGE + 7),  # heap: only the pages covered entirely
               (base + 30 * HUGE_PAGE + 3, base + 31 * HUGE_PAGE),  # heap: no page covered entirely
               (base + 39 * HUGE_PAGE, base + 45 * HUGE_PAGE),  # heap: clipped to the mapping
               (base + 51 * HUGE_PAGE, base + 55 * HUGE_PAGE),  # already advised for huge pages
               (base + 71 * HUGE_PAGE, base + 75 * HUGE_PAGE)]  # shared memory
    assert movable_ranges(weights, [file_map, heap, advised, shared]) == [
        (base + 3 * HUGE_PAGE, base + 5 * HUGE_PAGE), (base + 8 * HUGE_PAGE, base + 9 * HUGE_PAGE),
        (base + 22 * HUGE_PAGE, base + 24 * HUGE_PAGE), (base + 39 * HUGE_PAGE, base + 40 * HUGE_PAGE)]


class Weights(nn.Module):
    def __init__(self, *tensors: torch.Tensor):
        super().__init__()
        for i, t in enumerate(tensors):
            self.register_buffer(f"w{i}", t)


def mapping_of(address: int) -> Mapping:
    return next(m for m in read_mappings() if m.start <= address < m.end)


@linux_thp
def test_weights_keep_their_addresses_and_bytes_while_a_reader_runs(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "weights.bin"
    path.write_bytes(rng.integers(0, 256, 24 * MIB + 12345, dtype=np.uint8).tobytes())
    mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c")[12345:])  # a private map of a file
    private = mmap.mmap(-1, 24 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # fresh, as a large malloc's
    heap = torch.frombuffer(private, dtype=torch.float32)
    heap.copy_(torch.randn(heap.numel()))
    model = Weights(mapped, heap)
    expected = [mapped.clone(), heap.clone()]
    addresses = [mapped.data_ptr(), heap.data_ptr()]
    assert not mapping_of(mapped.data_ptr()).huge_advised and not mapping_of(heap.data_ptr()).huge_advised
    assert len(weight_ranges(model)) == 2

    stop, reads = threading.Event(), []
    def reader():  # sums the weights all along the swap: every read sees the same bytes
        while not stop.is_set():
            reads.append((int(mapped.sum(dtype=torch.int64)), float(heap.sum())))
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        moved = move_weights_to_huge_pages(model)
    finally:
        stop.set()
        thread.join()
    assert moved >= 20 * MIB  # nearly all of both (the file map's edges and the heap's partial pages stay)
    assert [mapped.data_ptr(), heap.data_ptr()] == addresses
    assert torch.equal(mapped, expected[0]) and torch.equal(heap, expected[1])
    assert reads and set(reads) == {(int(expected[0].sum(dtype=torch.int64)), float(expected[1].sum()))}
    middle = [mapping_of(t.data_ptr() + t.nbytes // 2) for t in (mapped, heap)]
    assert all(m.huge_advised and not m.file for m in middle)
    assert move_weights_to_huge_pages(model) == 0  # nothing left to move


def test_the_warm_up_moves_the_engines_weights_without_changing_a_token(tmp_path, monkeypatch):
    """A GGUF file's Q4_K blocks run from its map; the runner's warm-up thread swaps the model's weights while
    requests may run, and the tokens equal those of an engine whose weights never moved."""
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", T.Q4_K))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    calls = []  # (model, bytes moved or None): other engines' warm-ups (the suite's) may call too
    monkeypatch.setattr(warm_up, "move_weights_to_huge_pages", lambda model: calls.append((model, None)))
    unmoved = LLM(path, kv_cache_memory=8 << 20, enforce_eager=True)
    assert not unmoved.wait_for_warm_up()
    expected = [o.outputs[0].token_ids for o in unmoved.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(warm_up, "move_weights_to_huge_pages",
                        lambda model: calls.append((model, move_weights_to_huge_pages(model))))
    llm = LLM(path, kv_cache_memory=8 << 20, enforce_eager=True)
    during = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.wait_for_warm_up()
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert any(m is unmoved.llm_engine.model_runner.model and n is None for m, n in calls)
    assert any(m is llm.llm_engine.model_runner.model and isinstance(n, int) for m, n in calls)
    assert during == after == expected
    assert_all_blocks_free(llm.llm_engine)
