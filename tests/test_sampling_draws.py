"""`random_sample` (layers/sampler.py), the draw behind every sampled token and the rejection samplers' residuals:
tokens follow the rows' weights across its chunks of SAMPLE_CHUNK tokens and a vocabulary's last, shorter chunk
(chi-square at a false-alarm rate of 1e-3, the test's power shown on a wrong distribution), a token of weight 0 is never
drawn, and a seeded row draws the same tokens alone or in a batch. Top-k and top-p, which look for the tokens they keep
among a row's largest logits (`torch.topk`), keep what sorting the whole row keeps."""
import torch

from conftest import chi_square_p_value
from inferno.layers.sampler import SAMPLE_CHUNK, apply_top_k_top_p, random_sample

P_VALUE_THRESHOLD = 1e-3
VOCAB = 2 * SAMPLE_CHUNK + 188  # two whole chunks and a short one


def draws(weights: torch.Tensor, rows: int, calls: int) -> torch.Tensor:
    return torch.cat([random_sample(weights.expand(rows, -1).contiguous(), {}) for _ in range(calls)])


def test_draws_follow_unnormalised_weights_across_the_chunks():
    torch.manual_seed(0)
    weights = 37.0 * (0.5 + torch.rand(VOCAB))
    weights[torch.rand(VOCAB) < 0.3] = 0.0
    tokens = draws(weights, 4000, 50)
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert counts[weights == 0].sum() == 0
    drawn = weights > 0
    probs = (weights[drawn] / weights.sum()).double()
    assert chi_square_p_value(counts[drawn], probs) > P_VALUE_THRESHOLD
    assert chi_square_p_value(counts[drawn], probs.roll(1)) < P_VALUE_THRESHOLD  # the check has power


def test_a_token_of_weight_zero_is_never_drawn():
    """Weight only at chunk edges, in the short last chunk, or tiny beside zeros: every draw lands on it."""
    torch.manual_seed(1)
    rows = torch.zeros(5, VOCAB)
    rows[0, SAMPLE_CHUNK - 1] = rows[0, SAMPLE_CHUNK] = 1.0
    rows[1, VOCAB - 1] = 1e-30
    rows[2, 0] = 3.0
    rows[3, 2 * SAMPLE_CHUNK] = 1.0
    rows[3, 5] = 1e-12
    rows[4] = torch.rand(VOCAB) * (torch.arange(VOCAB) % 7 == 0)
    tokens = torch.stack([random_sample(rows.clone(), {}) for _ in range(2000)], dim=1)
    for row, drawn in zip(rows, tokens):
        assert (row[drawn] > 0).all()
    assert set(tokens[0].tolist()) == {SAMPLE_CHUNK - 1, SAMPLE_CHUNK}


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_a_batch():
    torch.manual_seed(2)
    weights = torch.rand(6, VOCAB)

    def seeded(batch: torch.Tensor, row: int) -> list[int]:
        generator = torch.Generator().manual_seed(7)
        return [int(random_sample(batch.clone(), {row: generator})[row]) for _ in range(30)]

    alone = seeded(weights[3:4], 0)
    assert seeded(weights, 3) == alone
    assert len(set(alone)) > 20  # draws, not one token over and over


def reference_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The kept tokens by the definitions, from each row sorted whole (float64): the k largest logits, then the most
    likely of those until the mass ranked above a token reaches p."""
    kept = torch.zeros_like(logits, dtype=torch.bool)
    for row, (k, p) in enumerate(zip(top_k.tolist(), top_p.tolist())):
        order = logits[row].double().sort(descending=True).indices
        order = order[:k] if 0 < k < len(order) else order
        probs = logits[row, order].double().softmax(dim=-1)
        kept[row, order[probs.cumsum(dim=-1) - probs < p]] = True
    return kept


def test_top_k_and_top_p_keep_what_sorting_the_whole_vocabulary_keeps():
    """Rows whose nucleus ends among their 256 most likely tokens, among 4096, or only in the whole row (flat), with
    and without top-k, top-p of 1 (off) too."""
    torch.manual_seed(3)
    vocab, rows = 10000, 24
    spread = torch.tensor([8.0, 3.0, 1.5, 0.3]).repeat(rows // 4).unsqueeze(1)
    logits = torch.randn(rows, vocab) * spread
    top_k = torch.tensor([0, 50, 0, 300, 0, 5000] * (rows // 6))
    top_p = torch.rand(rows) * 0.9 + 0.05
    top_p[::7] = 1.0
    kept = apply_top_k_top_p(logits, top_k, top_p).isfinite()
    expected = reference_top_k_top_p(logits, top_k, top_p)
    sizes = expected.sum(dim=-1)
    assert (sizes < 256).any() and ((sizes > 256) & (sizes < 4096)).any() and (sizes > 4096).any()
    assert torch.equal(kept, expected)


def test_rows_of_nan_or_infinite_weights_still_get_a_token_id():
    """A penalty that overflows a logit (repetition_penalty 5e-324 divides it to inf; softmax gives NaN) must not
    end the request with an index error: the draw is arbitrary, the id valid."""
    weights = torch.rand(4, VOCAB)
    weights[0] = float("nan")
    weights[1, 7] = float("inf")
    weights[2, -1] = float("nan")
    tokens = random_sample(weights, {})
    assert ((tokens >= 0) & (tokens < VOCAB)).all()
