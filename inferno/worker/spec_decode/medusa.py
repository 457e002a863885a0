"""Medusa heads propose a chain of drafts from the target's own hidden state, without a second model.

After a step, the target's runner keeps each request's final hidden state at its last accepted position p (whose
logits gave the token at p + 1, `ModelRunner.draft_hidden`). Head j (0-based) maps it, after the target's final
norm, to the token at p + 2 + j: draft j + 1 of the chain. Greedy requests take each head's top-1; sampled ones
draw from its processed softmax, passed on as the draft distribution so that rejection sampling keeps the target's
output distribution exact (any proposal distribution does, when the draft is drawn from it).

With a token tree (`speculative_token_tree`), a request the policy lets propose one gets, for each path of ranks
in it (cut to its allowed depth), the token of that rank in the matching head's top-k: Medusa's tree. Its nodes
are verified as point masses (layers/tree_rejection_sampler.py), exact whatever the request's sampling.
"""
import torch

from inferno.config import ModelConfig
from inferno.core.scheduler_output import DraftOutput
from inferno.core.spec_tree import tree_of_paths
from inferno.loader.medusa_folder import MedusaFolder, read_medusa_folder
from inferno.model.medusa import MedusaHeads
from inferno.worker.model_runner import ModelRunner
from inferno.worker.spec_decode.draft_sampling import sample_drafts
from inferno.worker.spec_decode.drafting_request import DraftingRequest


def build_medusa_heads(folder: MedusaFolder, hidden: int, vocab: int) -> MedusaHeads:
    """The heads of `folder` as a float32 module, checked against the target's hidden and vocabulary sizes."""
    bias = any(b is not None for blocks in folder.blocks for _, b in blocks)
    heads = MedusaHeads(folder.num_heads, folder.num_layers, hidden, vocab, folder.lm_heads is not None, bias)
    tensors = {}
    for h, blocks in enumerate(folder.blocks):
        for i, (weight, b) in enumerate(blocks):
            tensors[f"blocks.{h}.{i}.linear.weight"] = weight
            if bias:
                tensors[f"blocks.{h}.{i}.linear.bias"] = b if b is not None else torch.zeros(hidden)
        if folder.lm_heads is not None:
            tensors[f"lm_heads.{h}.weight"] = folder.lm_heads[h]
    params = heads.state_dict()
    for name, value in tensors.items():
        if value.shape != params[name].shape:
            raise ValueError(f"Medusa tensor {name} has shape {tuple(value.shape)} but the target (hidden size "
                             f"{hidden}, vocabulary {vocab}) needs {tuple(params[name].shape)}")
    heads.load_state_dict(tensors)
    return heads.eval()


def load_medusa_heads(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device) -> MedusaHeads:
    """The heads in the model dtype (the target's activations'), on `device`."""
    heads = build_medusa_heads(read_medusa_folder(path), target.hidden_size, target.vocab_size)
    return heads.to(device=device, dtype=dtype)


class MedusaProposer:
    def __init__(self, heads: MedusaHeads, runner: ModelRunner,
                 token_tree: tuple[tuple[int, ...], ...] | None = None):
        self.heads = heads
        self.token_tree = token_tree
        self.runner = runner
        self.target = runner.model
        runner.draft_hidden = {}  # from now on the runner keeps each request's last hidden state

    @torch.inference_mode()
    def propose(self, requests: list[DraftingRequest]) -> DraftOutput:
        """min(num_draft_tokens, heads) drafts per request whose hidden state the last step left."""
        wanted, hidden = [], []
        for req in requests:
            kept = self.runner.draft_hidden.get(req.request_id)
            if kept is not None and kept[0] == req.num_tokens - 2:  # the hidden state that gave the last token
                wanted.append((req, min(req.num_draft_tokens, self.heads.num_heads)))
                hidden.append(kept[1])
        out = DraftOutput()
        if not wanted:
            return out
        normed = self.target.norm(torch.stack(hidden))
        logits = self.heads.logits(normed, self.target.lm_head, max(k for _, k in wanted))
        trees = {i for i, (req, _) in enumerate(wanted) if req.tree and self.token_tree is not None}
        for i in trees:
            self._propose_tree(wanted[i][0], logits[:wanted[i][1], i], out)
        drafts: list[list[int]] = [[] for _ in wanted]
        probs: list[list[torch.Tensor]] = [[] for _ in wanted]
        for depth in range(logits.shape[0]):
            active = [i for i, (_, k) in enumerate(wanted) if k > depth and i not in trees]
            if not active:
                continue
            tokens, q = sample_drafts(logits[depth, active], [(wanted[i][0], drafts[i]) for i in active],
                                      self.heads.vocab_size, self.runner.device)
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if q is not None and not wanted[i][0].sampling_params.greedy:
                    probs[i].append(q[row])
        for (req, _), tokens, q in zip(wanted, drafts, probs):
            if not tokens:  # a tree's
                continue
            out.spec_token_ids[req.request_id] = tokens
            if q:
                out.draft_probs[req.request_id] = torch.stack(q).cpu()
        return out

    def _propose_tree(self, req: DraftingRequest, logits: torch.Tensor, out: DraftOutput) -> None:
        """The token tree's nodes up to depth len(logits), from each head's top-k ([depth, vocab] logits)."""
        paths = [path for path in self.token_tree if len(path) <= logits.shape[0]]
        top = logits.topk(max(max(path) for path in paths) + 1, dim=-1).indices.tolist()
        out.spec_token_ids[req.request_id] = [top[len(path) - 1][path[-1]] for path in paths]
        out.spec_tree_parents[req.request_id] = list(tree_of_paths(paths).parents)
