"""Draft proposals: run the K draft depths after prefill and after each verify step."""
from typing import Dict, List

import torch

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput
from lightllm.common.basemodel.mtp_verify_torch import mtp_scatter_next_token_ids_torch
from lightllm.common.basemodel.triton_kernel.mtp_utils import mtp_scatter_next_token_ids
from lightllm.models.llama_mtp.model import LlamaMTPDraftModel

UNKNOWN_TOKEN = -1  # prefill: the next token of this position is not known yet


class DraftProposer:
    def __init__(self, draft_model: LlamaMTPDraftModel):
        self.model = draft_model
        self.mtp_step = draft_model.mtp_step

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.argmax(self.model.target.compute_logits(hidden), dim=-1)

    @torch.no_grad()
    def propose_after_verify(self, backend, rows, out: ModelOutput, next_ids: torch.Tensor, accept_len: torch.Tensor):
        """Every depth runs over all K+1 rows (no host sync); the scatter keeps, per request,
        the proposals of its last committed row as the next step's drafts.
        ``next_ids`` covers the real rows; padding rows (DP) run with token 0 and are not scattered."""
        k = self.mtp_step
        real = next_ids.shape[0]
        # [rows, K+1], rows = real + padding
        all_next = torch.zeros((out.hidden_states.shape[0], k + 1), dtype=torch.int64, device=next_ids.device)
        all_next[:real, 0] = next_ids
        hidden, tok = out.hidden_states, all_next[:, 0]
        for depth in range(k):
            hidden = self.model.forward_depth(depth, rows.model_input, hidden, tok)
            tok = self._greedy(hidden)
            all_next[:, depth + 1] = tok
        scatter = mtp_scatter_next_token_ids if next_ids.is_cuda else mtp_scatter_next_token_ids_torch
        scatter(
            backend.req_to_next_token_ids, rows.b_req_mtp_start_loc, all_next[:real], rows.b_req_idx[:real], accept_len
        )

    @torch.no_grad()
    def propose_after_prefill(
        self, backend, reqs, model_input: ModelInput, out: ModelOutput, chunk_starts: List[int],
        first_tokens: Dict[int, int],
    ) -> None:
        """Write draft KV for every prefilled position; for requests whose prompt is done,
        store the K proposals after the first generated token (``first_tokens``: item -> token)."""
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
        if done:
            last_rows = torch.tensor([item_rows[i][0] + item_rows[i][1] - 1 for i in done], device=dev)
            req_idx = torch.tensor([reqs[i].req_idx for i in done], device=dev)
            drafts = torch.stack([p[last_rows] for p in proposals], dim=1)  # [done, K]
            backend.req_to_next_token_ids[req_idx, 1:k + 1] = drafts
