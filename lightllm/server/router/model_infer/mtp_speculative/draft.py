"""Draft proposals: the K draft depths after prefill and after each verify step.

A proposer returns proposals; the decode step (``DecodeStep``) owns the tables they go to.
Every proposer has the calls of ``proposer.Proposer`` (``make_draft_proposer`` picks one per --mtp_mode):

    propose(model_input, out, first_tokens, accept_len) -> Proposal (all_next [rows, K+1], confidence)
    propose_after_prefill(reqs, model_input, out, chunk_starts, first_tokens) -> None or PrefillProposal
    kv_needs(draft_dirs, mtp_step) -> DraftKvNeeds (before any model loads)

A proposer with ``drafts_prefill_rows`` also drafts the rows of a step laid out as rows (a short
prefill, a mixed step) depth by depth (``propose_rows``, see step_rows.py); the others (dspark)
draft such a step with ``write_context`` and ``propose_mixed``. A prefill forward's prompts draft
with ``propose_after_prefill``.

A confidence is None or the proposals' confidences, one row per request: [requests, K] fp32.
"""
import itertools
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.models.llama_mtp.model import LlamaMTPDraftModel
from lightllm.server.router.model_infer.mtp_speculative.proposer import (
    DraftKvNeeds, PrefillProposal, PrefixCacheRule, Proposal,
)

UNKNOWN_TOKEN = -1  # prefill: the next token of this position is not known yet


def tokens_ahead(tokens: Sequence[int], start: int, n: int, width: int) -> np.ndarray:
    """[n, width] host int64 (a read-only view): row r, the prefill row of position s = start + r,
    holds tokens[s], tokens[s + 1], ..., tokens[s + width - 1], UNKNOWN_TOKEN past the end of
    ``tokens``. Reads only the rows' window of ``tokens``."""
    if n == 0:
        return np.empty((0, width), dtype=np.int64)
    window = np.full(n + width - 1, UNKNOWN_TOKEN, dtype=np.int64)
    known = tokens[start:start + n + width - 1]
    window[:len(known)] = known
    return sliding_window_view(window, width)[:n]


class DraftProposer:
    has_confidence = False  # proposals come without confidences
    uses_accept_len = False  # every row drafts: propose() ignores accept_len
    drafts_prefill_rows = True  # propose_rows: a short prefill's draft pass as graph rows

    def __init__(self, draft_model: LlamaMTPDraftModel):
        self.model = draft_model
        self.mtp_step = draft_model.mtp_step

    @staticmethod
    def kv_needs(draft_dirs: Sequence[str], mtp_step: int) -> DraftKvNeeds:
        """One KV buffer per depth (with attention; none without), nothing past a request's end."""
        return DraftKvNeeds(kv_layers=None, extra_positions=0)

    def prefix_cache_rule(self) -> PrefixCacheRule:
        """With attention, depth d's KV at position s is computed from the token at s + d + 1: a
        window of K tokens, and a decoded position's KV came from the draft's own guesses (not
        cached). Without attention the draft keeps no state per position."""
        if self.model.with_att:
            return PrefixCacheRule(draft_window=self.mtp_step, cache_decoded=False)
        return PrefixCacheRule()

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.target.greedy_ids(hidden)

    @torch.no_grad()
    def propose(
        self, model_input: ModelInput, out: ModelOutput, first_tokens: torch.Tensor, accept_len: torch.Tensor
    ) -> Proposal:
        """The K draft depths over every decode row (no host sync, CUDA-graph safe).

        out: the target's rows (``LlamaMTPDraftModel.target_features`` reads them); first_tokens: [rows] int64, each
        row's verified token (padding rows: any valid id); accept_len: unused (every row drafts).
        Returns all_next [rows, K+1]: the verified token, then the K greedy proposals after it; the
        caller keeps each request's last committed row."""
        k = self.mtp_step
        hidden = self.model.target_features(out)
        all_next = torch.empty((hidden.shape[0], k + 1), dtype=torch.int64, device=hidden.device)
        all_next[:, 0] = first_tokens
        tok = first_tokens
        state = self.model.depth_state(model_input)
        for depth in range(k):
            hidden = self.model.forward_depth(depth, model_input, hidden, tok, state)
            tok = self._greedy(hidden)
            all_next[:, depth + 1] = tok
        return Proposal(all_next)

    @torch.no_grad()
    def propose_rows(self, model_input: ModelInput, out: ModelOutput, known: torch.Tensor,
                     sel: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The K depths over prefilled rows: known [K, rows] is the token row s takes at depth d
        (UNKNOWN_TOKEN: its guess at depth d - 1). Writes the draft KV of every row; returns the
        guesses [rows, K]. ``sel``: the only rows whose guesses can be needed (the others stay 0;
        entries equal to rows are unused, so a fixed-size ``sel`` suits CUDA graphs); None: every row."""
        hidden = self.model.target_features(out)
        rows = hidden.shape[0]
        guess = torch.zeros(rows, dtype=torch.int64, device=hidden.device)
        guesses = []
        state = self.model.depth_state(model_input)
        for d in range(self.mtp_step):
            tok = torch.where(known[d] == UNKNOWN_TOKEN, guess, known[d])
            hidden = self.model.forward_depth(d, model_input, hidden, tok, state)
            if sel is None:
                guess = self._greedy(hidden)
            else:  # one scratch row past the last takes the unused entries
                scattered = torch.zeros(rows + 1, dtype=torch.int64, device=hidden.device)
                scattered[sel] = self._greedy(hidden[sel.clamp(max=rows - 1)])
                guess = scattered[:rows]
            guesses.append(guess)
        return torch.stack(guesses, dim=1)

    @torch.no_grad()
    def propose_after_prefill(
        self, reqs, model_input: ModelInput, out: ModelOutput, chunk_starts: List[int],
        first_tokens: Dict[int, int],
    ) -> Optional[PrefillProposal]:
        """Write draft KV for every prefilled position. For requests whose prompt is done
        (``first_tokens``: item -> token) returns their req_idx [done], K proposals after the
        first generated token [done, K] and no confidences; None when no prompt is done."""
        k = self.mtp_step
        dev = out.hidden_states.device
        # Position s of depth d takes token x_{s+d+1}: known inside the prompt (and the first
        # generated token); otherwise the previous depth's greedy guess at s.
        lens = [req.kv_len - start for req, start in zip(reqs, chunk_starts)]
        last_rows = list(itertools.accumulate(lens))  # one past each item's last row
        known = np.full((k, out.hidden_states.shape[0]), UNKNOWN_TOKEN, dtype=np.int64)  # padding items (DP) too
        for i, (req, start, n, end) in enumerate(zip(reqs, chunk_starts, lens, last_rows)):
            # a finished prompt's window ends with its first token
            window = req.prompt_ids[start:start + n + k] + ([first_tokens[i]] if i in first_tokens else [])
            known[:, end - n:end] = tokens_ahead(window, 0, n, k + 1)[:, 1:].T
        sel = torch.tensor([r for end, n in zip(last_rows, lens) for r in range(end - min(n, k), end)],
                           dtype=torch.int64, device=dev)
        guesses = self.propose_rows(model_input, out, torch.from_numpy(known).to(dev), sel)
        done = sorted(first_tokens)
        if not done:
            return None
        last = torch.tensor([last_rows[i] - 1 for i in done], device=dev)
        req_idx = torch.tensor([reqs[i].req_idx for i in done], device=dev)
        return PrefillProposal(req_idx, guesses[last])  # [done, K]

def proposer_class(mtp_mode: str):
    """The one registry of draft modes: dspark drafts a block, the MTP modes draft depth by depth."""
    if mtp_mode == "dspark":
        from lightllm.server.router.model_infer.mtp_speculative.dspark import DSparkProposer

        return DSparkProposer
    return DraftProposer


def make_draft_proposer(mtp_mode: str, draft_dirs: List[str], mtp_step: int, target, max_reqs: int):
    """The proposer of ``mtp_mode`` over ``target``. ``max_reqs``: most requests one decode step holds,
    padding included."""
    if mtp_mode == "dspark":
        from lightllm.models.dspark.model import DSparkDraftModel

        return proposer_class(mtp_mode)(DSparkDraftModel(draft_dirs[0], mtp_step, target, max_reqs))
    return DraftProposer(LlamaMTPDraftModel(draft_dirs, mtp_mode, mtp_step, target))
