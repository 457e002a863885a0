"""The cost of verifying a draft tree: one target step of --batch requests each verifying the same draft tokens as a
token tree (--tree, Medusa-style paths of ranks) or as a chain, next to a plain decode step, per CPU attention
backend (the PyTorch path masks each tree row's keys; the native kernel attends every row, then a tree's rows that
hide a branch again on the masked PyTorch path). Same context (--context tokens) and tokens for every variant;
ms per step, median of --repeats. Verification only: no proposer, no sampling.

    python benchmarks/tree_verify.py --batch 1 4 --repeats 20
"""
import argparse
import statistics
import time

import torch

from inferno import LLM
from inferno.core.spec_tree import SpecTree, tree_of_paths
from inferno.request import Request
from inferno.sampling_params import SamplingParams
from inferno.speculative_config import SpeculativeConfig
from inferno.worker.input_batch import StepInput, TokenChunk, lay_out_chunks

DEFAULT_TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


def step_ms(engine, chunks: list[TokenChunk], repeats: int) -> float:
    mb = lay_out_chunks(chunks, engine.config.block_size)
    mb.logit_rows = list(range(len(mb.input_ids)))  # verification scores every row
    step = StepInput([mb], [])
    engine.executor.run_step(step)  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.executor.run_step(step)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(backend: str, args, tree: SpecTree) -> None:
    # eager: a chain's rows could otherwise run the compiled decode step, which a tree's never do
    engine = LLM(attention_backend=backend, kv_cache_memory=256 << 20, num_threads=args.num_threads,
                 enforce_eager=True).llm_engine
    num_drafts = tree.num_nodes - 1
    for batch in args.batch:
        requests = [Request(f"r{i}", list(range(100, 100 + args.context)), SamplingParams(), set(),
                            engine.max_model_len) for i in range(batch)]
        for req in requests:
            assert engine.kv_cache_manager.allocate_slots(req, args.context + num_drafts)
        try:
            bs = engine.config.block_size
            engine.executor.run_step(StepInput([lay_out_chunks(
                [TokenChunk(req.prompt_token_ids[:-1], 0, req.block_ids) for req in requests], bs)], []))
            drafts = list(range(200, 200 + num_drafts))

            def chunks(shape: SpecTree | None, tokens: list[int]) -> list[TokenChunk]:
                return [TokenChunk(req.prompt_token_ids[-1:] + tokens, args.context - 1, req.block_ids, tree=shape)
                        for req in requests]
            decode, chain, as_tree = (step_ms(engine, chunks(shape, tokens), args.repeats)
                                      for shape, tokens in ((None, []), (None, drafts), (tree, drafts)))
            print(f"{backend:10} batch {batch:2}: decode {decode:7.2f} ms | {num_drafts} drafts as a chain "
                  f"{chain:7.2f} ms | as a tree {as_tree:7.2f} ms ({as_tree / chain:.2f}x the chain)", flush=True)
        finally:
            for req in requests:
                engine.kv_cache_manager.free(req)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=DEFAULT_TREE, help="speculative_token_tree paths, as vLLM takes them")
    parser.add_argument("--backends", nargs="+", default=["cpu_kernel", "torch"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    paths = SpeculativeConfig.from_dict({"method": "medusa", "model": "-", "num_speculative_tokens": 1,
                                         "speculative_token_tree": args.tree}).speculative_token_tree
    torch.manual_seed(0)
    for backend in args.backends:
        measure(backend, args, tree_of_paths(paths))


if __name__ == "__main__":
    main()
