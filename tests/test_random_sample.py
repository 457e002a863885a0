"""`random_sample` (layers/sampler.py), the draw behind every sampled token and the rejection samplers' residuals:
tokens follow the rows' weights across its chunks of SAMPLE_CHUNK tokens and a vocabulary's last, shorter chunk
(chi-square at a false-alarm rate of 1e-3, the test's power shown on a wrong distribution), a token of weight 0 is never
drawn, and a seeded row draws the same tokens alone or in a batch."""
import torch

from inferno.layers.sampler import SAMPLE_CHUNK, random_sample

P_VALUE_THRESHOLD = 1e-3
VOCAB = 2 * SAMPLE_CHUNK + 188  # two whole chunks and a short one


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2), statistic / 2))


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
