"""Command line: `inferno generate "prompt"` and `inferno chat`, streaming tokens as they come."""
import argparse
import json
import logging
import sys
import uuid

from inferno.config import EngineConfig, SpeculativeConfig
from inferno.engine.llm_engine import LLMEngine
from inferno.sampling_params import RequestOutputKind, SamplingParams
from inferno.server.cli_args import add_server_args, server_config


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="activation dtype (auto: bfloat16 where the CPU has native bfloat16 GEMMs, else float32)")
    parser.add_argument("--quantization", "-q", default=d.quantization, choices=["auto", "none", "int8", "int4"],
                        help="weights: auto runs a GGUF file's quantized blocks as stored; none dequantizes them to "
                             "float; int8 / int4 quantize every projection (default: auto)")
    parser.add_argument("--quantization-group-size", type=int, default=d.quantization_group_size,
                        choices=[32, 64, 128, -1],
                        help="input columns per scale and zero point; -1: per output channel (int8 only)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory,
                        help="bytes for the KV cache (default: half the memory available after loading the model, "
                             "at most --max-num-seqs sequences of --max-model-len tokens)")
    parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "int8", "fp8_e4m3"],
                        help="KV cache storage (auto: the model dtype; int8/fp8: per-token-per-head scales)")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="threads per rank (default: all cores, divided among the ranks)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                        help="ranks that split every layer (Megatron-style tensor parallelism)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=d.pipeline_parallel_size,
                        help="ranks that each run a contiguous stage of the layers")
    parser.add_argument("--distributed-timeout", type=float, default=d.distributed_timeout,
                        help="seconds a rank waits inside a step for the others before the engine fails")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=d.enable_prefix_caching, help="reuse the KV cache of prompts' common prefixes")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d.enforce_eager,
                        help="run every step in eager PyTorch (default for `generate`, whose one request ends before "
                             "a compile would; otherwise decode steps switch to a torch.compile'd forward once a "
                             "background thread has built it, serving eagerly until then)")
    parser.add_argument("--speculative-config", type=speculative_config, default=None,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5, '
                             '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": "draft.gguf", '
                             '"num_speculative_tokens": 4}\'; policy keys "disable_by_batch_size" (default 4, '
                             'null: never) and "draft_acceptance_threshold" (default 0.3 for ngram, 0.5 for '
                             'draft_model; 0: off)')


def speculative_config(text: str) -> SpeculativeConfig:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    try:
        return SpeculativeConfig.from_dict(config)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    quantization = None if args.quantization == "none" else args.quantization
    return EngineConfig(model=args.model, dtype=args.dtype, quantization=quantization,
                        quantization_group_size=args.quantization_group_size, max_model_len=args.max_model_len,
                        kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
                        block_size=args.block_size,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                        num_threads=args.num_threads, tensor_parallel_size=args.tensor_parallel_size,
                        pipeline_parallel_size=args.pipeline_parallel_size,
                        distributed_timeout=args.distributed_timeout, enable_prefix_caching=args.enable_prefix_caching,
                        enforce_eager=args.enforce_eager, speculative_config=args.speculative_config)


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


def stream(engine: LLMEngine, prompt: str | dict, params: SamplingParams) -> str:
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


def chat_prompt(engine: LLMEngine, messages: list[dict]) -> dict:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}


def run_generate(args: argparse.Namespace) -> None:
    engine = LLMEngine(engine_config(args))
    try:
        prompt = chat_prompt(engine, [{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        stream(engine, prompt, sampling_params(args))
    finally:
        engine.shutdown()


def run_chat(args: argparse.Namespace) -> None:
    engine = LLMEngine(engine_config(args))
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
        reply = stream(engine, chat_prompt(engine, messages), params)
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
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        parser.exit(2, f"inferno: error: {e}\n")


if __name__ == "__main__":
    main()
