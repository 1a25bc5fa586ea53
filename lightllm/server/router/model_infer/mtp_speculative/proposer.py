"""The proposer interface: what a draft gives the decode flow, and what it needs of the KV pool.

``make_draft_proposer`` (draft.py) picks one per --mtp_mode; the decode step (``DecodeStep``)
and the backend own every table the proposals go to.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence

import torch

from lightllm.common.basemodel.batch_objs import ModelInput, ModelOutput


@dataclass(frozen=True)
class DraftKvNeeds:
    """What a draft adds to the KV pool and the request table (sized before any model loads)."""

    kv_layers: Optional[int]  # KV buffers beside the target's; None: one per MTP depth
    extra_positions: int  # request-table positions past the longest request (a block written past its anchor)


@dataclass
class Proposal:
    """Proposals after a decode step's verification."""

    all_next: torch.Tensor  # [rows, K + 1] int64: each row's verified token, then the K proposals after it
    confidence: Optional[torch.Tensor] = None  # [requests, K] fp32, drafts that report them


@dataclass
class PrefillProposal:
    """The first K proposals of the prompts a prefill step finished."""

    req_idx: torch.Tensor  # [done] int64
    drafts: torch.Tensor  # [done, K] int64
    confidence: Optional[torch.Tensor] = None  # [done, K] fp32


@dataclass
class MixedAnchors:
    """Where a rows step's blocks start: its decode requests (K + 1 rows each, first in the step; none in
    a prefill-only step), then the prompts whose last chunk it ran. Device tensors."""

    verified: torch.Tensor  # [decode rows] int64: each decode row's verified token
    accept_len: torch.Tensor  # [n] int32: rows each decode request kept
    row0_seq_len: torch.Tensor  # [n] int32: keys row 0 of each decode request sees (its KV length + 1)
    req_idx: torch.Tensor  # [n]: the decode requests' rows of the request table
    first_req_idx: torch.Tensor  # [m]: the finished prompts' rows
    first_pos: torch.Tensor  # [m] int64: each finished prompt's length (its first token's position)
    first_ids: torch.Tensor  # [m] int64: their first tokens


@dataclass
class MixedProposal:
    """A mixed step's proposals: every decode row's, then each finished prompt's."""

    guesses: torch.Tensor  # [decode rows + m, K] int64
    confidence: Optional[torch.Tensor] = None  # [n + m, K] fp32, drafts that report them


@dataclass(frozen=True)
class PrefixCacheRule:
    """What a draft's per-position state lets the prompt cache share (prompt_cache.py)."""

    draft_window: int = 0  # the draft's KV at position s reads the tokens up to s + draft_window (0: none past s)
    cache_decoded: bool = True  # a decoded position's draft state equals a prefill's: outputs are cached too


class Proposer(Protocol):
    mtp_step: int
    has_confidence: bool  # proposals come with confidences
    uses_accept_len: bool  # propose() reads each request's accept length
    drafts_prefill_rows: bool  # propose_rows: a prefill's (and a mixed step's) draft pass over rows
    # without drafts_prefill_rows, a rows step: write_context(model_input, out), then
    # propose_mixed(MixedAnchors, max_len) -> MixedProposal (dspark.py)

    @staticmethod
    def kv_needs(draft_dirs: Sequence[str], mtp_step: int) -> DraftKvNeeds: ...

    def prefix_cache_rule(self) -> PrefixCacheRule: ...

    def propose(self, model_input: ModelInput, out: ModelOutput, first_tokens: torch.Tensor,
                accept_len: torch.Tensor) -> Proposal: ...

    def propose_after_prefill(self, reqs: list, model_input: ModelInput, out: ModelOutput, chunk_starts: List[int],
                              first_tokens: Dict[int, int]) -> Optional[PrefillProposal]: ...
