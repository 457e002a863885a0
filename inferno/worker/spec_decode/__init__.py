"""Speculative decoding on rank 0 of the executor: the proposers of draft tokens (n-gram prompt lookup, a draft
model). The engine's speculation policy (inferno/spec_decode/) decides which requests speculate and with how many
drafts; after a step's output is applied it asks rank 0 for them (`DraftRequest`s, plain data), and the drafts come
back as a `DraftOutput`, to be verified by the next step's rejection sampler (layers/rejection_sampler.py)."""
