"""Constrained decoding (structured outputs): a grammar per request masks the tokens it may sample next.

The grammar library is llguidance. Against xgrammar (benchmarks/grammar_backends.py) it compiles a new schema
faster, so a request with a new schema waits less, and its slower per-token mask is still a negligible share of a
CPU decode step. llguidance installs alone (no dependencies), while xgrammar requires torch, transformers and, on
Linux x86-64, triton; it also validates schemas without a tokenizer (the front door's cheap check) and rolls back
consumed tokens (speculative drafts).
"""
