"""Draft proposals: the K draft depths after prefill and after each verify step.

The proposer returns proposals; the decode step (``DecodeStep``) owns the tables they go to."""
from typing import Dict, List, Optional, Tuple

import torch

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.models.llama_mtp.model import LlamaMTPDraftModel

UNKNOWN_TOKEN = -1  # prefill: the next token of this position is not known yet


class DraftProposer:
    def __init__(self, draft_model: LlamaMTPDraftModel):
        self.model = draft_model
        self.mtp_step = draft_model.mtp_step

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.argmax(self.model.target.compute_logits(hidden), dim=-1)

    @torch.no_grad()
    def propose(self, model_input: ModelInput, hidden: torch.Tensor, first_tokens: torch.Tensor) -> torch.Tensor:
        """The K draft depths over every decode row (no host sync, CUDA-graph safe).

        hidden: [rows, hidden] the target's last layer; first_tokens: [rows] int64, each row's
        verified token (padding rows: any valid id). Returns [rows, K+1]: the verified token,
        then the K greedy proposals after it; the caller keeps each request's last committed row."""
        k = self.mtp_step
        all_next = torch.empty((hidden.shape[0], k + 1), dtype=torch.int64, device=hidden.device)
        all_next[:, 0] = first_tokens
        tok = first_tokens
        for depth in range(k):
            hidden = self.model.forward_depth(depth, model_input, hidden, tok)
            tok = self._greedy(hidden)
            all_next[:, depth + 1] = tok
        return all_next

    @torch.no_grad()
    def propose_after_prefill(
        self, reqs, model_input: ModelInput, out: ModelOutput, chunk_starts: List[int],
        first_tokens: Dict[int, int],
    ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """Write draft KV for every prefilled position. For requests whose prompt is done
        (``first_tokens``: item -> token) returns their req_idx [done] and K proposals
        after the first generated token [done, K]; None when no prompt is done."""
        k = self.mtp_step
        dev = out.hidden_states.device
        # Position s of depth d takes token x_{s+d+1}: known inside the prompt (and the first
        # generated token); otherwise the previous depth's greedy guess at s.
        item_rows, rows_of_last_k, tail_tokens = [], [], []
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
        return req_idx, torch.stack([p[last_rows] for p in proposals], dim=1)  # [done, K]
