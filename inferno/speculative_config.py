"""vLLM's `speculative_config`, parsed: who proposes draft tokens, how many, as chains or token trees, and when
requests do not speculate. `EngineConfig.speculative_config` takes it as a dict (inferno/config.py)."""
import ast
from dataclasses import dataclass

SPEC_METHODS = ("ngram", "draft_model", "medusa", "eagle")
# methods whose "model" is a folder of heads over the target's own hidden states (no second model)
HEAD_METHODS = ("medusa", "eagle")
DYNAMIC_TREE = "dynamic"  # speculative_token_tree: EAGLE-2's tree, grown from the head's scores at each step
# defaults of the speculation policy (benchmarks/spec_decode.py): batch 1 verifies a few extra tokens almost for
# free, while in a large batch a step's cost grows with its tokens (the matmuls are compute-bound there), so
# verifying drafts costs more throughput than the accepted tokens bring. Requests whose drafts are mostly rejected
# (n-gram on chat) pause.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
# a draft position pays when its chance of acceptance outweighs its cost: the extra row verified for n-gram drafts,
# that plus a pass of the draft model (a sizeable share of a target step) for a draft model; Medusa's heads cost
# a few small matmuls and one LM head pass per draft, an EAGLE head one decoder layer and an LM head pass
DEFAULT_DRAFT_ACCEPTANCE_THRESHOLD = {"ngram": 0.3, "draft_model": 0.5, "medusa": 0.3, "eagle": 0.3}


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: who proposes draft tokens, how many per step, and when not to speculate.

    Speculation only pays while the drafts that get accepted outweigh the extra tokens the target verifies (and,
    for a draft model, the draft's own passes). Two switches keep it from costing throughput:
    - `disable_by_batch_size` (vLLM's key): no request speculates in a step that starts with at least this many
      running requests (a large batch already keeps the hardware busy). None: never switched off by batch size
      (vLLM's default); inferno's default is DEFAULT_DISABLE_BY_BATCH_SIZE.
    - `draft_acceptance_threshold` (inferno's adaptive policy): each request estimates its own chance α that a
      draft is accepted (accepted vs rejected drafts of its recent verification steps, older ones decayed); it
      proposes draft position j only while α^j, the chance that position is reached and accepted, is at least
      the threshold (default DEFAULT_DRAFT_ACCEPTANCE_THRESHOLD, per method). A request below it at position 1
      stops proposing and probes with one draft every `PROBE_INTERVAL` steps (inferno/spec_decode/policy.py).
      0 turns the policy off (always k drafts).
    Neither changes what is generated: the output is the target's distribution (greedy: the same tokens) whatever
    the number of drafts, though a seeded sampled request's tokens depend on it.

    `speculative_token_tree` (vLLM's key; Medusa and EAGLE): the drafts of a request form a tree, given as the
    list of its nodes' paths of top-k ranks, one rank per draft position: (0,) is the best first draft (Medusa: head
    1's top token; EAGLE: the head's), (1,) the second best, (0, 0) the best second draft under (0,). Every prefix
    of a path must be a node too. With EAGLE, "dynamic" grows EAGLE-2's tree instead (SGLang's sizes: at each of
    num_speculative_tokens depths the `eagle_topk` best nodes by cumulative draft probability get `eagle_topk`
    children each, and the best num_draft_tokens - 1 nodes of all are verified). While few requests run
    (spec_decode/policy.py), each verifies its whole tree (cut to the depth the policy allows) in one pass and
    keeps the longest accepted branch; a busier batch verifies chains.
    """
    # "ngram" (prompt lookup) | "draft_model" | "medusa" | "eagle" (heads on the target's hidden states)
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int  # ngram: shortest suffix to look up
    prompt_lookup_max: int  # ngram: longest suffix to look up
    # draft_model: GGUF file or HF folder sharing the target's tokenizer; medusa, eagle: the heads' folder
    model: str | None
    disable_by_batch_size: int | None
    draft_acceptance_threshold: float
    speculative_token_tree: tuple[tuple[int, ...], ...] | str | None = None  # paths, or DYNAMIC_TREE
    eagle_topk: int = 4  # DYNAMIC_TREE: the nodes expanded per depth, and the children drafted per node
    num_draft_tokens: int = 8  # DYNAMIC_TREE: the tokens a tree verifies, its root (the last token) included

    @classmethod
    def from_dict(cls, config: dict) -> "SpeculativeConfig":
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                 "disable_by_batch_size", "draft_acceptance_threshold", "speculative_token_tree", "eagle_topk",
                 "num_draft_tokens"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known keys are {sorted(known)}")
        method = config.get("method") or ("draft_model" if config.get("model") else None)
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {list(SPEC_METHODS)}, got {method!r}")
        k = config.get("num_speculative_tokens")
        if not is_positive_int(k):
            raise ValueError(f"speculative_config num_speculative_tokens must be a positive integer, got {k!r}")
        # vLLM's defaults: both 5, or the one given for both
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        low, high = low if low is not None else (high or 5), high if high is not None else (low or 5)
        if method == "ngram":
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                if not is_positive_int(value):
                    raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
            if low > high:
                raise ValueError(f"speculative_config prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        model = config.get("model")
        if method == "draft_model" and not (isinstance(model, str) and model):
            raise ValueError("speculative_config with method 'draft_model' needs 'model': a GGUF file or HF folder")
        if method in HEAD_METHODS and not (isinstance(model, str) and model):
            raise ValueError(f"speculative_config with method {method!r} needs 'model': the heads' folder (written "
                             f"by `inferno train-draft-heads`, or a downloaded one)")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config 'model' is not used with method 'ngram'")
        disable = config.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if disable is not None and not is_positive_int(disable):
            raise ValueError(f"speculative_config disable_by_batch_size must be a positive integer or None, "
                             f"got {disable!r}")
        threshold = config.get("draft_acceptance_threshold", DEFAULT_DRAFT_ACCEPTANCE_THRESHOLD[method])
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
            raise ValueError(f"speculative_config draft_acceptance_threshold must be a number in [0, 1) "
                             f"(0: always propose num_speculative_tokens), got {threshold!r}")
        tree = config.get("speculative_token_tree")
        if tree is not None and method not in HEAD_METHODS:
            raise ValueError(f"speculative_config speculative_token_tree is supported with methods "
                             f"{list(HEAD_METHODS)} only, not {method!r}")
        if tree == DYNAMIC_TREE and method != "eagle":
            raise ValueError("speculative_config speculative_token_tree 'dynamic' (EAGLE-2's tree) needs method "
                             f"'eagle', not {method!r}")
        topk, num_tokens = config.get("eagle_topk", 4), config.get("num_draft_tokens", 8)
        if tree != DYNAMIC_TREE and ("eagle_topk" in config or "num_draft_tokens" in config):
            raise ValueError("speculative_config eagle_topk and num_draft_tokens size EAGLE-2's dynamic tree: they "
                             "need speculative_token_tree 'dynamic'")
        if not is_positive_int(topk):
            raise ValueError(f"speculative_config eagle_topk must be a positive integer, got {topk!r}")
        if not is_positive_int(num_tokens) or num_tokens < 2:
            raise ValueError(f"speculative_config num_draft_tokens (the tokens a tree verifies, its root included) "
                             f"must be an integer >= 2, got {num_tokens!r}")
        tree = tree if tree in (None, DYNAMIC_TREE) else _token_tree(tree)
        return cls(method, k, low, high, model, disable, float(threshold), tree, topk, num_tokens)

    @property
    def tree_width(self) -> int:
        """The most top tokens of one draft position a tree reads."""
        if self.speculative_token_tree == DYNAMIC_TREE:
            return self.eagle_topk
        return 1 + max(max(path) for path in self.speculative_token_tree)

    @property
    def num_tree_drafts(self) -> int | None:
        """The draft nodes of a whole tree (None: chains only)."""
        if self.speculative_token_tree == DYNAMIC_TREE:
            return self.num_draft_tokens - 1
        return None if self.speculative_token_tree is None else len(self.speculative_token_tree)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a running request needs beyond its scheduled tokens: where the draft model (or EAGLE head) writes
        its drafts' K/V. An EAGLE head drafting a tree writes one slot per inner node of the tree (cut to
        num_speculative_tokens deep: worker/spec_decode/eagle_tree.py)."""
        k, tree = self.num_speculative_tokens, self.speculative_token_tree
        if self.method == "eagle" and tree == DYNAMIC_TREE:  # eagle_topk passes at each depth but the last
            return max(k, self.eagle_topk * (k - 1))
        if self.method == "eagle" and tree is not None:
            return max(k, len({path[:-1] for path in tree if 1 < len(path) <= k}))
        return k if self.method in ("draft_model", "eagle") else 0


def _token_tree(value) -> tuple[tuple[int, ...], ...]:
    """A token tree's node paths (a list of tuples or lists of ranks, or its text as vLLM takes it), checked."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"speculative_config speculative_token_tree is not a list of tuples: {value!r}") from None
    error = ValueError("speculative_config speculative_token_tree must be a non-empty list of paths, each a "
                       f"non-empty list of ranks >= 0 whose prefixes are paths too; got {value!r}")
    if not isinstance(value, (list, tuple)) or not value:
        raise error
    paths = []
    for path in value:
        if not isinstance(path, (list, tuple)) or not path or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path):
            raise error
        paths.append(tuple(path))
    if len(set(paths)) < len(paths) or any(path[:-1] and path[:-1] not in paths for path in paths):
        raise error
    return tuple(sorted(paths, key=lambda path: (len(path), path)))


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
