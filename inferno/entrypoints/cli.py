"""Command line: `inferno generate "prompt"` and `inferno chat`, streaming tokens as they come; `inferno serve`;
`inferno calibrate` (SmoothQuant factors for quantization w8a8); `inferno train-draft-heads` (Medusa and EAGLE
heads)."""
import argparse
import json
import logging
import sys
import uuid
from dataclasses import MISSING, Field, fields
from typing import get_args

from inferno.core.startup_gc import gc_paused

with gc_paused(freeze=True):  # importing torch and inferno builds objects as long-lived as the process (startup_gc)
    from inferno.config import (ATTENTION_BACKENDS, DEVICES, DTYPES, KV_CACHE_DTYPE_NAMES,
                                PER_CHANNEL, QUANTIZATION_GROUP_SIZES, QUANTIZATION_METHODS, RUNNERS,
                                EngineConfig)
    from inferno.core.head_training import HeadTrainingConfig
    from inferno.core.kv_transfer import KV_ROLES, KV_TRANSFER_BACKENDS, KV_TRANSFER_FALLBACKS
    from inferno.engine.input_processor import PromptType
    from inferno.engine.llm_engine import LLMEngine
    from inferno.entrypoints.env import run_env
    from inferno.entrypoints.llm import LLM
    from inferno.entrypoints.train_draft_heads import read_prompts, read_sequences, read_texts, train_draft_heads
    from inferno.sampling_params import RequestOutputKind, SamplingParams
    from inferno.server.cli_args import add_server_args, server_config
    from inferno.speculative_config import SpeculativeConfig


def speculative_config(text: str) -> SpeculativeConfig:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    try:
        return SpeculativeConfig.from_dict(config)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# every EngineConfig field is a flag named after it (--kv-cache-memory), typed and defaulted by the field; this
# table adds short names, choices and help
ENGINE_FLAGS: dict[str, dict] = {
    "model": dict(help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)"),
    "device": dict(choices=DEVICES, help="where the model runs (auto: CUDA when torch sees a GPU, else the CPU)"),
    "dtype": dict(choices=["auto", *DTYPES],
                  help="activation dtype (auto: float32 between the CPU's integer kernels (quantized GGUF, "
                       "AWQ/GPTQ, int4); bfloat16 on GPUs and, for float weights, on CPUs with native bfloat16 "
                       "GEMMs; else float32)"),
    "quantization": dict(short="-q", choices=[*QUANTIZATION_METHODS, "none"],
                         help="weights: auto runs a GGUF file's quantized blocks (or an AWQ / GPTQ folder's codes) "
                              "as stored; none dequantizes them to float; int8 / int4 quantize every projection; "
                              "w8a8: int8 weights and activations, calibrated smoothing (default: auto)"),
    "quantization_group_size": dict(choices=[*QUANTIZATION_GROUP_SIZES, PER_CHANNEL],
                                    help="input columns per scale and zero point; -1: per output channel (int8 only)"),
    "calibration": dict(help="w8a8: the activation calibration file written by `inferno calibrate` (default: the "
                             "one beside the model)"),
    "kv_cache_memory": dict(help="bytes for the KV cache (default: half the memory available after loading the "
                                 "model, at most --max-num-seqs sequences of --max-model-len tokens)"),
    "kv_cache_dtype": dict(choices=KV_CACHE_DTYPE_NAMES,
                           help="KV cache storage (auto: the model dtype if 16-bit, float16 under a float32 model on "
                                "the CPU; int8/fp8: per-token-per-head scales)"),
    "gpu_memory_utilization": dict(help="CUDA: fraction of the GPU's memory for weights, activations and the KV "
                                        "cache (default 0.9)"),
    "attention_backend": dict(choices=ATTENTION_BACKENDS, help="auto: Triton on CUDA; on the CPU the native "
                                                               "kernel where it can run the model, else PyTorch"),
    "num_threads": dict(help="threads per rank (default: all cores, divided among the ranks)"),
    "tensor_parallel_size": dict(short="-tp", help="ranks that split every layer (Megatron-style tensor parallelism)"),
    "pipeline_parallel_size": dict(short="-pp", help="ranks that each run a contiguous stage of the layers"),
    "distributed_timeout": dict(help="seconds a rank waits inside a step for the others before the engine fails"),
    "enable_prefix_caching": dict(help="reuse the KV cache of prompts' common prefixes (default: on, but off for "
                                       "--runner pooling)"),
    "enforce_eager": dict(help="run every step in eager PyTorch (default for `generate`, whose one request ends "
                               "before a compile would; otherwise decode steps switch to a torch.compile'd forward "
                               "once a background thread has built it, serving eagerly until then)"),
    "speculative_config": dict(type=speculative_config, help=(
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5, '
        '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": "draft.gguf", '
        '"num_speculative_tokens": 4}\' or \'{"method": "medusa" (or "eagle"), "model": "heads/", '
        '"num_speculative_tokens": 3}\'; policy keys "disable_by_batch_size" (default 4, null: never) and '
        '"draft_acceptance_threshold" (default 0.3 for ngram, medusa and eagle, 0.5 for draft_model; 0: off)')),
    "kv_role": dict(choices=KV_ROLES, help="disaggregated serving: prefill instances compute prompts, decode instances "
                                           "pull their KV cache and decode (put `inferno proxy` in front)"),
    "kv_host": dict(help="prefill: the address decode instances reach its KV cache at (default: 127.0.0.1)"),
    "kv_port": dict(help="prefill: the TCP port it listens on for decode instances' KV pulls"),
    "kv_transfer_backend": dict(choices=KV_TRANSFER_BACKENDS, help="torch.distributed backend of KV transfers"),
    "kv_transfer_timeout": dict(help="seconds a KV transfer may take; a prefill instance frees blocks nobody "
                                     "pulled after this long"),
    "kv_transfer_fallback": dict(choices=KV_TRANSFER_FALLBACKS,
                                 help="decode, when a KV transfer fails: compute the prompt here, or fail the request"),
    "enable_lora": dict(help="serve LoRA adapters on the base model (docs/lora.md)"),
    "max_loras": dict(help="LoRA adapters that can run in one step (each has a slot of stacked weights)"),
    "max_lora_rank": dict(help="the highest LoRA rank accepted (the slots' size)"),
    "max_cpu_loras": dict(help="LoRA adapters kept in memory beyond the slots (least recently used dropped and "
                               "read again when needed; default: --max-loras)"),
    "runner": dict(choices=RUNNERS, help="generate: text generation (embeddings on request too); pooling: an "
                                         "embedding model, which only answers /v1/embeddings (docs/embeddings.md)"),
}
NOT_FLAGS = {"seed"}  # the engine's seed is not a flag: --seed is the request's (SamplingParams.seed)


def engine_fields() -> list[Field]:
    return [f for f in fields(EngineConfig) if f.name not in NOT_FLAGS]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f in engine_fields():
        options = dict(ENGINE_FLAGS.get(f.name, {}))
        names = ["--" + f.name.replace("_", "-"), *([options.pop("short")] if "short" in options else [])]
        default = f.default if f.default is not MISSING else f.default_factory()
        value_type = next(t for t in get_args(f.type) or [f.type] if t is not type(None))
        if value_type is bool:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=default, **options)
        else:
            parser.add_argument(*names, type=options.pop("type", value_type), default=default, **options)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in engine_fields()}
    if values["quantization"] == "none":  # the flag's spelling of None: dequantize a GGUF file to float
        values["quantization"] = None
    return EngineConfig(**values)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                          output_kind=RequestOutputKind.DELTA)


def stream(engine: LLMEngine, prompt: PromptType, params: SamplingParams) -> str:
    """Run one request, printing text deltas as they arrive; returns the whole text."""
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    pieces = []
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                for completion in output.outputs:
                    print(completion.text, end="", flush=True)
                    pieces.append(completion.text)
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    print()
    return "".join(pieces)


def start_engine(args: argparse.Namespace) -> LLMEngine:
    """The command's engine; what start-up built is then frozen out of the cyclic collector's scans (the command
    owns its process: core/startup_gc.py)."""
    with gc_paused(freeze=True):
        return LLMEngine(engine_config(args))


def run_generate(args: argparse.Namespace) -> None:
    engine = start_engine(args)
    try:
        prompt = engine.input_processor.render_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        stream(engine, prompt, sampling_params(args))
    finally:
        engine.shutdown()


def run_chat(args: argparse.Namespace) -> None:
    engine = start_engine(args)
    try:
        chat_loop(engine, args)
    finally:
        engine.shutdown()


def chat_loop(engine: LLMEngine, args: argparse.Namespace) -> None:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    params = sampling_params(args)
    print("inferno chat — an empty line or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        reply = stream(engine, engine.input_processor.render_chat(messages), params)
        messages.append({"role": "assistant", "content": reply})


def run_serve(args: argparse.Namespace) -> None:
    from inferno.server.app import run_server  # fastapi and uvicorn load only for `serve`
    # the engine's start-up report (what fits in the KV cache, when decode runs compiled) next to uvicorn's lines
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger = logging.getLogger("inferno")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    args.model = args.model_tag or args.model
    run_server(engine_config(args), server_config(args))


def run_proxy(args: argparse.Namespace) -> None:
    from inferno.server.disagg_proxy import run_proxy as run  # fastapi and uvicorn load only for `proxy`
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    if args.health_check_interval <= 0:
        raise ValueError(f"health_check_interval must be positive, got {args.health_check_interval}")
    local = {} if args.local_prefill_below is None else {"local_prefill_below": args.local_prefill_below}
    if local.get("local_prefill_below", 0) < 0:
        raise ValueError(f"local_prefill_below must be at least 0, got {args.local_prefill_below}")
    run(args.prefill, args.decode, args.host, args.port, args.health_check_interval, **local)


def run_calibrate(args: argparse.Namespace) -> None:
    texts = [open(path, encoding="utf-8").read() for path in args.text_file] if args.text_file else None
    llm = LLM(args.model, dtype="float32", quantization=None, kv_cache_memory=64 << 20, enforce_eager=True,
              num_threads=args.num_threads)
    try:
        path = llm.calibrate(args.output, texts, args.smoothing)
    finally:
        llm.llm_engine.shutdown()
    print(f"wrote {path}")


def run_train_draft_heads(args: argparse.Namespace) -> None:
    config = HeadTrainingConfig(args.method, args.num_heads, args.num_layers, args.epochs, args.learning_rate,
                                args.batch_size, args.held_out_fraction, args.draft_vocab_size or None, args.seed,
                                args.unroll_steps)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if (args.prompts is not None and args.sequences is not None) or not (args.prompts or args.sequences or args.texts):
        raise SystemExit("train-draft-heads: give --prompts (to generate continuations) or --sequences (saved ones), "
                         "and/or --texts")
    prompts = None if args.prompts is None else read_prompts(args.prompts)
    llm = LLM(args.model, enforce_eager=True, num_threads=args.num_threads, kv_cache_memory=args.kv_cache_memory)
    try:
        sequences = [] if args.sequences is None else read_sequences(args.sequences,
                                                                     llm.llm_engine.model_config.vocab_size)
        for path in args.texts or []:
            sequences += read_texts(path, llm.get_tokenizer(), args.text_tokens)
        accuracy = train_draft_heads(llm, prompts, args.output, config, params, sequences, args.save_sequences)
    finally:
        llm.llm_engine.shutdown()
    per = "draft depth" if args.method == "eagle" else "head"
    print(f"wrote {args.output}; held-out top-1 accuracy per {per}: {' '.join(f'{a:.3f}' for a in accuracy)}")


def add_train_draft_heads(commands) -> None:
    train = commands.add_parser("train-draft-heads", help="distil speculative heads (Medusa, EAGLE) from a model "
                                                          "on prompts it continues itself")
    train.add_argument("model", help="GGUF file or Hugging Face folder: the target the heads will draft for")
    train.add_argument("--method", default="medusa", choices=["medusa", "eagle"],
                       help="medusa: heads on the last hidden state; eagle: one decoder layer run autoregressively")
    train.add_argument("--prompts", help='JSON lines: {"prompt": "..."} or {"messages": [...]}')
    train.add_argument("--sequences", help="train on these saved sequences instead of generating from --prompts "
                                           "(written by --save-sequences, by this model or one sharing its tokenizer)")
    train.add_argument("--texts", action="append", help='JSON lines {"text": "..."}: your own corpus (code, chat), '
                       "cut into sequences of --text-tokens; the heads learn the target's predictions over them (no "
                       "generation; with --prompts or --sequences, added to them); repeatable")
    train.add_argument("--text-tokens", type=int, default=512, help="tokens per sequence cut from --texts")
    train.add_argument("--save-sequences", help="write the training sequences (prompt and continuation token ids) "
                                                "here as JSON lines, to train again without generating")
    train.add_argument("--output", "-o", required=True, help="the heads' folder to write")
    defaults = HeadTrainingConfig()
    train.add_argument("--num-heads", type=int, default=defaults.num_heads,
                       help="Medusa: heads, so drafts per step at most (head j predicts j + 2 tokens ahead)")
    train.add_argument("--num-layers", type=int, default=defaults.num_layers,
                       help="Medusa: residual blocks per head")
    train.add_argument("--max-tokens", type=int, default=256, help="tokens generated per prompt")
    train.add_argument("--temperature", type=float, default=0.0,
                       help="of the generated continuations (0: greedy, what greedy serving will see)")
    train.add_argument("--epochs", type=int, default=defaults.epochs)
    train.add_argument("--learning-rate", type=float, default=None,
                       help="default: 1e-3 for Medusa, 2e-4 for EAGLE (whose layer starts as the target's last)")
    train.add_argument("--batch-size", type=int, default=defaults.batch_size, help="positions per optimizer step")
    train.add_argument("--held-out-fraction", type=float, default=defaults.held_out_fraction,
                       help="of the prompts, never trained on: where the accuracy shown is measured")
    train.add_argument("--draft-vocab-size", type=int, default=defaults.draft_vocab_size,
                       help="EAGLE: the head's own LM head covers the most frequent tokens of the training data "
                            "(EAGLE-3's draft vocabulary, written as d2t: a cheaper draft); 0: the target's whole one")
    train.add_argument("--unroll-steps", type=int, default=defaults.unroll_steps,
                       help="EAGLE: draft steps unrolled in training, each after the first reading the head's own "
                            "output as its drafts do (EAGLE-3's training-time test; costs as many passes); 1: "
                            "teacher forcing alone")
    train.add_argument("--seed", type=int, default=defaults.seed)
    train.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache for the generation")
    train.add_argument("--num-threads", type=int, default=None)
    train.set_defaults(func=run_train_draft_heads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="inferno", description="LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate a completion for one prompt, streamed")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(enforce_eager=True)  # see --enforce-eager
    gen.set_defaults(func=run_generate)
    chat = commands.add_parser("chat", help="interactive chat, streamed")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=run_chat)
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, help="GGUF file or Hugging Face folder (as --model)")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=run_serve)
    proxy = commands.add_parser("proxy", help="OpenAI-compatible front for disaggregated prefill and decode instances")
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances' base URLs")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances' base URLs")
    proxy.add_argument("--host", default="0.0.0.0")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.add_argument("--health-check-interval", type=float, default=2.0,
                       help="seconds between two /health checks of each instance")
    proxy.add_argument("--local-prefill-below", type=int, default=None, metavar="TOKENS",
                       help="prompts shorter than this are computed on the decode instance, longer ones on a prefill "
                            "instance (default 512; 0: every prompt goes through a prefill instance)")
    proxy.set_defaults(func=run_proxy)
    calibrate = commands.add_parser("calibrate", help="calibrate SmoothQuant factors for --quantization w8a8")
    calibrate.add_argument("model", nargs="?", default=None, help="GGUF file or Hugging Face folder (default: "
                                                                  "SmolLM2-135M-Instruct)")
    calibrate.add_argument("--output", "-o", default=None, help="where to write the factors (JSON; default: "
                                                               "beside the model, where w8a8 looks for them)")
    calibrate.add_argument("--smoothing", type=float, default=None,
                           help="SmoothQuant migration strength alpha in [0, 1] for every projection: input channels "
                                "are divided by max|x|^alpha / max|w|^(1-alpha) and weight columns multiplied by it "
                                "(0: none; default: each projection type's own, tuned on SmolLM2)")
    calibrate.add_argument("--text-file", action="append", default=None,
                           help="UTF-8 text to calibrate on (repeatable; default: a built-in sample)")
    calibrate.add_argument("--num-threads", type=int, default=None)
    calibrate.set_defaults(func=run_calibrate)
    add_train_draft_heads(commands)
    env = commands.add_parser("env", help="print the versions, CPU, kernel library and caches a bug report needs")
    env.set_defaults(func=lambda args: run_env())
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        parser.exit(2, f"inferno: error: {e}\n")


if __name__ == "__main__":
    main()
