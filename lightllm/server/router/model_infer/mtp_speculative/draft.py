"""Draft proposals: the K draft depths after prefill and after each verify step.

A proposer returns proposals; the decode step (``DecodeStep``) owns the tables they go to.
Every proposer has the same two calls (``make_draft_proposer`` picks one per --mtp_mode):

    propose(model_input, out, first_tokens, accept_len) -> (all_next [rows, K+1], conf)
    propose_after_prefill(reqs, model_input, out, chunk_starts, first_tokens)
        -> None or (req_idx [done], drafts [done, K], conf)

A proposer with ``drafts_prefill_rows`` also drafts a short prefill run as decode rows
(``propose_rows``, see prefill_rows.py); the others draft every prefill with
``propose_after_prefill``.

``conf`` is None or the proposals' confidences, one row per request: [requests, K] fp32.
"""
from typing import Dict, List, Optional, Tuple

import torch

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.models.llama_mtp.model import LlamaMTPDraftModel

UNKNOWN_TOKEN = -1  # prefill: the next token of this position is not known yet


class DraftProposer:
    has_confidence = False  # proposals come without confidences
    uses_accept_len = False  # every row drafts: propose() ignores accept_len
    drafts_prefill_rows = True  # propose_rows: a short prefill's draft pass as graph rows

    def __init__(self, draft_model: LlamaMTPDraftModel):
        self.model = draft_model
        self.mtp_step = draft_model.mtp_step

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.argmax(self.model.target.compute_logits(hidden), dim=-1)

    @torch.no_grad()
    def propose(
        self, model_input: ModelInput, out: ModelOutput, first_tokens: torch.Tensor, accept_len: torch.Tensor
    ) -> Tuple[torch.Tensor, None]:
        """The K draft depths over every decode row (no host sync, CUDA-graph safe).

        out.hidden_states: [rows, hidden] the target's last layer; first_tokens: [rows] int64, each
        row's verified token (padding rows: any valid id); accept_len: unused (every row drafts).
        Returns [rows, K+1]: the verified token, then the K greedy proposals after it; the caller
        keeps each request's last committed row."""
        k = self.mtp_step
        hidden = out.hidden_states
        all_next = torch.empty((hidden.shape[0], k + 1), dtype=torch.int64, device=hidden.device)
        all_next[:, 0] = first_tokens
        tok = first_tokens
        for depth in range(k):
            hidden = self.model.forward_depth(depth, model_input, hidden, tok)
            tok = self._greedy(hidden)
            all_next[:, depth + 1] = tok
        return all_next, None

    @torch.no_grad()
    def propose_rows(self, model_input: ModelInput, out: ModelOutput, known: torch.Tensor) -> torch.Tensor:
        """A prefill as decode rows (no host sync, CUDA-graph safe): known [K, rows] is the token
        row s takes at depth d (UNKNOWN_TOKEN: the previous depth's guess at s). Writes the draft
        KV of every row; returns every row's guess at every depth [rows, K]."""
        hidden = out.hidden_states
        guess = torch.zeros(hidden.shape[0], dtype=torch.int64, device=hidden.device)
        guesses = []
        for d in range(self.mtp_step):
            tok = torch.where(known[d] == UNKNOWN_TOKEN, guess, known[d])
            hidden = self.model.forward_depth(d, model_input, hidden, tok)
            guess = self._greedy(hidden)
            guesses.append(guess)
        return torch.stack(guesses, dim=1)

    @torch.no_grad()
    def propose_after_prefill(
        self, reqs, model_input: ModelInput, out: ModelOutput, chunk_starts: List[int],
        first_tokens: Dict[int, int],
    ) -> Optional[Tuple[torch.Tensor, torch.Tensor, None]]:
        """Write draft KV for every prefilled position. For requests whose prompt is done
        (``first_tokens``: item -> token) returns their req_idx [done], K proposals after the
        first generated token [done, K] and no confidences; None when no prompt is done."""
        k = self.mtp_step
        dev = out.hidden_states.device
        # Position s of depth d takes token x_{s+d+1}: known inside the prompt (and the first
        # generated token); otherwise the previous depth's greedy guess at s.
        item_rows, rows_of_last_k = [], []
        row = 0
        for i, (req, start) in enumerate(zip(reqs, chunk_starts)):
            n = req.kv_len - start
            item_rows.append((row, n, start))
            rows_of_last_k.extend(range(row + max(0, n - k), row + n))
            row += n
        row = out.hidden_states.shape[0]  # the requests' rows, then padding items (DP), if any
        known = [[UNKNOWN_TOKEN] * row for _ in range(k)]
        for i, (req, (r0, n, start)) in enumerate(zip(reqs, item_rows)):
            seq = req.prompt_ids + ([first_tokens[i]] if i in first_tokens else [])
            for d in range(k):
                for o in range(n):
                    q = start + o + d + 1
                    if q < len(seq):
                        known[d][r0 + o] = seq[q]
        sel = torch.tensor(rows_of_last_k, dtype=torch.int64, device=dev)
        hidden = out.hidden_states
        guess = torch.zeros(row, dtype=torch.int64, device=dev)
        proposals = []
        for d in range(k):
            tok = torch.tensor(known[d], dtype=torch.int64, device=dev)
            tok = torch.where(tok == UNKNOWN_TOKEN, guess, tok)
            hidden = self.model.forward_depth(d, model_input, hidden, tok)
            guess = torch.zeros(row, dtype=torch.int64, device=dev)
            guess[sel] = self._greedy(hidden[sel])
            proposals.append(guess)
        done = sorted(first_tokens)
        if not done:
            return None
        last_rows = torch.tensor([item_rows[i][0] + item_rows[i][1] - 1 for i in done], device=dev)
        req_idx = torch.tensor([reqs[i].req_idx for i in done], device=dev)
        return req_idx, torch.stack([p[last_rows] for p in proposals], dim=1), None  # [done, K]


def make_draft_proposer(mtp_mode: str, draft_dirs: List[str], mtp_step: int, target, max_reqs: int):
    """The one registry of draft modes: dspark drafts a block, the MTP modes draft depth by depth.
    ``max_reqs``: most requests one decode step holds, padding included."""
    if mtp_mode == "dspark":
        from lightllm.models.dspark.model import DSparkDraftModel
        from lightllm.server.router.model_infer.mtp_speculative.dspark import DSparkProposer

        return DSparkProposer(DSparkDraftModel(draft_dirs[0], mtp_step, target, max_reqs))
    return DraftProposer(LlamaMTPDraftModel(draft_dirs, mtp_mode, mtp_step, target))
