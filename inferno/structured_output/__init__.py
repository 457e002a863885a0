"""Constrained decoding (structured outputs): a grammar per request masks the tokens it may sample next.

The grammar library is llguidance. Measured against xgrammar (benchmarks/grammar_backends.py, RESULTS.md): a
nested JSON schema compiles in 2 ms (49k vocabulary) / 17 ms (152k) vs xgrammar's 12 / 35 ms, so a request with a
new schema waits less; a mask costs llguidance ~0.1 ms per token vs xgrammar's ~0.01 ms, both well under 1% of a
CPU decode step. llguidance installs alone (no dependencies), while xgrammar requires torch, transformers and, on
Linux x86-64, triton; it also validates schemas without a tokenizer (the front door's cheap check) and rolls back
consumed tokens (speculative drafts).
"""
