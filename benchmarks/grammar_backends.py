"""Grammar libraries compared for structured outputs: llguidance (what inferno uses) vs xgrammar.

For the default model's 49k vocabulary and Qwen2.5's 152k one: the one-off tokenizer setup, the compile time of a
nested JSON schema, and the time to fill one token mask and advance by one token (over a valid reply). xgrammar is
not a dependency of inferno: `pip install --no-deps xgrammar apache-tvm-ffi` to run this.

    python benchmarks/grammar_backends.py [--qwen models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf]
"""
import argparse
import json
import time

import llguidance
import llguidance.torch
import xgrammar

from inferno.loader.model_loader import default_model_path
from inferno.loader.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]},
    "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"]},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "scores", "address"], "additionalProperties": False}
REPLY = ('{"name": "Alice", "age": 30, "role": "admin", "scores": [1.5, 2], '
         '"address": {"street": "Main", "zip": "12345"}}')


def timed(f):
    start = time.perf_counter()
    result = f()
    return result, (time.perf_counter() - start) * 1e3


def measure_llguidance(tokenizer: Tokenizer, token_ids: list[int]) -> tuple[float, float, float]:
    eos = sorted(tokenizer.eos_token_ids)
    ll_tokenizer, setup = timed(lambda: llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size,
                                                               eos_token=eos))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher, compile_ms = timed(lambda: llguidance.LLMatcher(ll_tokenizer, grammar))
    mask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)

    def run():
        for t in token_ids:
            llguidance.torch.fill_next_token_bitmask(matcher, mask)
            assert matcher.consume_token(t)
    _, steps = timed(run)
    return setup, compile_ms, steps / len(token_ids)


def measure_xgrammar(tokenizer: Tokenizer, token_ids: list[int]) -> tuple[float, float, float]:
    vocab = [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]

    def setup():
        info = xgrammar.TokenizerInfo(vocab, vocab_type=xgrammar.VocabType.BYTE_LEVEL,
                                      vocab_size=tokenizer.vocab_size,
                                      stop_token_ids=sorted(tokenizer.eos_token_ids))
        return xgrammar.GrammarCompiler(info, max_threads=1)
    compiler, setup_ms = timed(setup)
    compiled, compile_ms = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)

    def run():
        for t in token_ids:
            matcher.fill_next_token_bitmask(mask)
            assert matcher.accept_token(t)
    _, steps = timed(run)
    return setup_ms, compile_ms, steps / len(token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qwen", default=None, help="a Qwen2.5 GGUF (152k vocabulary)")
    args = parser.parse_args()
    print("| library | vocab | tokenizer setup ms | schema compile ms | mask + advance ms/token |")
    print("|---|---:|---:|---:|---:|")
    for path in [default_model_path(), args.qwen]:
        if path is None:
            continue
        tokenizer = Tokenizer.from_gguf(path)
        token_ids = tokenizer.encode(REPLY, add_special_tokens=False)
        for name, measure in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
            setup, compile_ms, step = measure(tokenizer, token_ids)
            print(f"| {name} | {tokenizer.vocab_size} | {setup:.0f} | {compile_ms:.1f} | {step:.3f} |")


if __name__ == "__main__":
    main()
