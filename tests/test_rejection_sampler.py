"""The rejection sampler emits tokens distributed exactly as the target's; n-gram lookup; speculative_config checks.

Statistical tests: chi-square goodness of fit over many samples on a 6-token vocabulary, each at a false-alarm rate
fixed up front (p-value threshold 1e-3); every test also shows the same check rejects a wrong distribution.
"""
import numpy as np
import pytest
import torch

from conftest import chi_square_p_value
from inferno.config import EngineConfig
from inferno.core.spec_tree import SpecTree, tree_of_paths
from inferno.layers.rejection_sampler import Drafts, rejection_sample
from inferno.layers.tree_rejection_sampler import TreeDrafts, tree_rejection_sample
from inferno.layers.sampler import SamplingMetadata
from inferno.speculative_config import SpeculativeConfig
from inferno.worker.spec_decode.ngram import ngram_lookup

P_VALUE_THRESHOLD = 1e-3
NUM_TRIALS = 20000
# target distributions p_0, p_1, p_2 (for the tokens after 0, 1 and 2 drafts) and draft distributions q_0, q_1
TARGET = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.07, 0.03],
                       [0.05, 0.10, 0.40, 0.05, 0.30, 0.10],
                       [0.10, 0.10, 0.10, 0.20, 0.20, 0.30]])
DRAFT = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10],
                      [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])


def metadata(num_rows: int, temperature: float = 1.0) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.full((num_rows,), temperature), all_greedy=temperature == 0,
                            top_k=None, top_p=None, min_p=None, generators={}, penalty_rows=[],
                            repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
                            prompt_tokens=[], output_token_ids=[], banned_token_ids={}, max_num_logprobs=None)


def emitted_tokens(drafts: list[list[int]], draft_probs: torch.Tensor | None) -> list[list[int]]:
    k = len(drafts[0])
    logits = TARGET[:k + 1].log().repeat(len(drafts), 1)
    batch = [Drafts(d, None if draft_probs is None else draft_probs, None) for d in drafts]
    return rejection_sample(logits, metadata(len(logits)), batch)


def assert_position_matches(emitted: list[list[int]], position: int, probs: torch.Tensor) -> None:
    tokens = torch.tensor([e[position] for e in emitted if len(e) > position])
    assert len(tokens) > 1000
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert chi_square_p_value(counts, probs.double()) > P_VALUE_THRESHOLD
    # the check has power: the same samples do not fit a wrong distribution (here the draft's q or a shifted p)
    assert chi_square_p_value(counts, probs.roll(1).double()) < P_VALUE_THRESHOLD


def test_drafts_from_a_different_distribution_yield_the_target_distribution():
    torch.manual_seed(0)
    drafts = torch.stack([torch.multinomial(DRAFT[j], NUM_TRIALS, replacement=True) for j in range(2)], dim=1)
    emitted = emitted_tokens(drafts.tolist(), DRAFT)
    assert_position_matches(emitted, 0, TARGET[0])
    assert_position_matches(emitted, 1, TARGET[1])  # reached only after the first draft was accepted
    assert_position_matches(emitted, 2, TARGET[2])  # the bonus token
    first = torch.tensor([e[0] for e in emitted])
    assert chi_square_p_value(torch.bincount(first, minlength=6).double(), DRAFT[0].double()) < P_VALUE_THRESHOLD


def test_point_mass_drafts_yield_the_target_distribution():
    """n-gram drafts carry no distribution: q is one-hot on the proposed token."""
    torch.manual_seed(1)
    emitted = emitted_tokens([[1, 4]] * NUM_TRIALS, None)
    assert_position_matches(emitted, 0, TARGET[0])
    assert_position_matches(emitted, 1, TARGET[1])
    accepted_first = sum(len(e) > 1 for e in emitted) / NUM_TRIALS
    assert abs(accepted_first - TARGET[0, 1].item()) < 0.02  # accepted with probability p_0(1)


def test_draft_identical_to_target_is_always_accepted():
    torch.manual_seed(2)
    drafts = torch.stack([torch.multinomial(TARGET[j], 500, replacement=True) for j in range(2)], dim=1)
    emitted = emitted_tokens(drafts.tolist(), TARGET[:2])
    assert all(e[:2] == d for e, d in zip(emitted, drafts.tolist()))
    assert all(len(e) == 3 for e in emitted)


def test_greedy_accepts_while_drafts_equal_the_argmax():
    logits = TARGET.log()  # argmax 0, then 2, then 5
    cases = {(0, 2): [0, 2, 5], (0, 3): [0, 2], (1, 2): [0], (0,): [0, 2]}
    for draft, expected in cases.items():
        rows = logits[:len(draft) + 1]
        assert rejection_sample(rows, metadata(len(rows), 0.0), [Drafts(list(draft), None, None)]) == [expected]


def test_seeded_verification_is_reproducible():
    def run(seed: int) -> list[list[int]]:
        batch = [Drafts([1, 4], None, torch.Generator().manual_seed(seed + i)) for i in range(50)]
        return rejection_sample(TARGET.log().repeat(50, 1), metadata(150), batch)
    assert run(5) == run(5)
    assert run(5) != run(6)


# n-gram prompt lookup
# a tree of drafts: the root (the request's last token) has children 1 (token 1) and 2 (token 3); node 1 has
# children 3 (token 4) and 4 (token 2); node 2 has child 5 (token 5). TREE_TARGET[n]: the target's p after node n.
TREE = SpecTree((0, 0, 1, 1, 2))
TREE_TOKENS = [1, 3, 4, 2, 5]
TREE_TARGET = torch.tensor([[0.10, 0.35, 0.05, 0.30, 0.10, 0.10],
                            [0.05, 0.10, 0.25, 0.10, 0.35, 0.15],
                            [0.20, 0.10, 0.10, 0.10, 0.10, 0.40],
                            [0.15, 0.15, 0.25, 0.15, 0.15, 0.15],
                            [0.30, 0.10, 0.10, 0.20, 0.20, 0.10],
                            [0.10, 0.20, 0.30, 0.10, 0.20, 0.10]])


def tree_verdicts(num_trials: int, temperature: float = 1.0, generator_seed: int | None = None):
    logits = TREE_TARGET.log().repeat(num_trials, 1)
    generator = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
    drafts = [TreeDrafts(TREE_TOKENS, TREE, generator) for _ in range(num_trials)]
    return tree_rejection_sample(logits, metadata(len(logits), temperature), drafts)


def test_tree_verification_yields_the_target_distribution_on_every_branch():
    """SpecInfer's rule over a tree: the first token is distributed as p_0 whichever children exist, and after an
    accepted node n the next token as p_n (a sibling tried and rejected first does not skew it)."""
    torch.manual_seed(3)
    verdicts = tree_verdicts(NUM_TRIALS)
    emitted = [v.token_ids for v in verdicts]
    assert_position_matches(emitted, 0, TREE_TARGET[0])
    for prefix, node in (([1], 1), ([3], 2), ([1, 4], 3), ([1, 2], 4)):
        after = [e[len(prefix):] for e in emitted if e[:len(prefix)] == prefix and len(e) > len(prefix)]
        assert_position_matches(after, 0, TREE_TARGET[node])
    # the walk kept exactly the nodes whose tokens it emitted, a root-to-node path of the tree
    for verdict in verdicts[:200]:
        nodes = verdict.accepted_nodes
        assert nodes == TREE.ancestors(nodes[-1])
        assert verdict.token_ids[:-1] == [TREE_TOKENS[n - 1] for n in nodes[1:]]
    # the first child is accepted with probability p_0(1), the second when the first is not, with p_0(3)
    first = torch.tensor([e[0] for e in emitted])
    accepted_second = sum(v.accepted_nodes[1:2] == [2] for v in verdicts) / NUM_TRIALS
    assert abs((first == 1).double().mean().item() - 0.35) < 0.02
    assert abs(accepted_second - 0.30) < 0.02


def test_greedy_tree_verification_follows_the_longest_matching_branch():
    """Argmaxes: p_0 -> 1 (node 1), p_1 -> 4 (node 3, a leaf): the bonus token is p_3's argmax."""
    verdict, = tree_verdicts(1, temperature=0.0)
    assert verdict.accepted_nodes == [0, 1, 3]
    assert verdict.token_ids == [1, 4, int(TREE_TARGET[3].argmax())]
    # the argmax on the second branch: node 2 then its child 5 are taken, skipping the first branch
    logits = TREE_TARGET.log().clone()
    logits[0, 3] = 0.0
    logits[2, 5] = 0.0
    verdict, = tree_rejection_sample(logits, metadata(len(logits), 0.0), [TreeDrafts(TREE_TOKENS, TREE, None)])
    assert verdict.accepted_nodes == [0, 2, 5]
    assert verdict.token_ids == [3, 5, int(logits[5].argmax())]


def test_seeded_tree_verification_is_reproducible():
    first = [v.token_ids for v in tree_verdicts(50, generator_seed=7)]
    assert first == [v.token_ids for v in tree_verdicts(50, generator_seed=7)]
    assert first != [v.token_ids for v in tree_verdicts(50, generator_seed=8)]


def test_ngram_proposes_what_followed_the_latest_match():
    tokens = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    assert ngram_lookup(tokens, 1, 3, 2) == [7, 8]  # the latest earlier "1 2 3" was followed by 7 8
    assert ngram_lookup(tokens, 1, 3, 10) == [7, 8, 5, 1, 2, 3]  # runs up to the end of the sequence
    assert ngram_lookup(np.array([4, 5, 6, 5]), 1, 3, 3) == [6, 5]  # only a 1-gram matches
    assert ngram_lookup(np.array([4, 5, 6, 5]), 2, 3, 3) == []  # shorter than prompt_lookup_min
    assert ngram_lookup(np.array([4]), 1, 3, 3) == []


# speculative_config
def test_speculative_config_follows_vllm():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 5, 4, 4)
    draft = SpeculativeConfig.from_dict({"model": "draft.gguf", "num_speculative_tokens": 3})
    assert (draft.method, draft.num_lookahead_tokens) == ("draft_model", 3)
    # the speculation policy: inferno's defaults, vLLM's None for "never switch off by batch size"
    assert (spec.disable_by_batch_size, spec.draft_acceptance_threshold) == (4, 0.3)
    assert draft.draft_acceptance_threshold == 0.5  # a draft model's passes cost more than a lookup
    policy = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                          "disable_by_batch_size": None, "draft_acceptance_threshold": 0})
    assert (policy.disable_by_batch_size, policy.draft_acceptance_threshold) == (None, 0.0)
    # a token tree: paths of top-k ranks, laid out shortest first; vLLM's string form reads the same
    tree = {"method": "medusa", "model": "heads", "num_speculative_tokens": 2}
    parsed = SpeculativeConfig.from_dict(tree | {"speculative_token_tree": [[0, 0], [1], [0]]})
    assert parsed.speculative_token_tree == ((0,), (1,), (0, 0))
    assert SpeculativeConfig.from_dict(tree | {"speculative_token_tree": "[(0,), (1,), (0, 0)]"}) == parsed
    assert tree_of_paths(parsed.speculative_token_tree) == SpecTree((0, 0, 1))


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle3", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min \\(3\\) must be <= prompt_lookup_max \\(2\\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown keys"),
    ("ngram", "must be a dict"),
    ({"method": "medusa", "model": "h", "num_speculative_tokens": 2, "speculative_token_tree": [(0,), (1, 0)]},
     "prefixes are paths too"),
    ({"method": "medusa", "model": "h", "num_speculative_tokens": 2, "speculative_token_tree": [(0,), (0,)]},
     "prefixes are paths too"),
    ({"method": "medusa", "model": "h", "num_speculative_tokens": 2, "speculative_token_tree": []},
     "non-empty list of paths"),
    ({"method": "medusa", "model": "h", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,"},
     "not a list of tuples"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": [(0,)]},
     "with methods \\['medusa', 'eagle'\\] only"),
    ({"method": "eagle", "model": "h", "num_speculative_tokens": 2, "speculative_token_tree": [(0, 0)]},
     "prefixes are paths too"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_acceptance_threshold": 1.0},
     "draft_acceptance_threshold must be a number in \\[0, 1\\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_acceptance_threshold": "high"},
     "draft_acceptance_threshold must be"),
])
def test_bad_speculative_config_is_a_value_error(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)
