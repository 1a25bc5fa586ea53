"""sample(): penalties -> logit bias -> grammar mask -> temperature -> greedy / top-k / top-p, per row."""
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from lightllm.common.basemodel.triton_kernel.token_logprobs import token_logprobs_triton
from lightllm.common.req_manager import ReqSamplingParamsManager
from lightllm.server.core.objs.sampling_params import TOP_K_GREEDY
from lightllm.server.router.model_infer.grammar import BITS_PER_WORD

# Processed logits are clamped to [-LOGIT_LIMIT, LOGIT_LIMIT] after every stage whose math can
# overflow (a tiny temperature or repetition penalty, a huge logit bias): far beyond any real
# logit, and sums of a few stay finite in fp32, so softmax, logsumexp and ASD regrets never
# meet inf - inf (NaN). Ordinary logits never reach it, so ordinary results are unchanged.
LOGIT_LIMIT = 1e30
# Temperatures below fp32's smallest normal (1e-50 is stored as 0) are raised to it: 0 / 0 is NaN.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


def _finite(logits: torch.Tensor) -> torch.Tensor:
    return logits.clamp(-LOGIT_LIMIT, LOGIT_LIMIT)


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [rows] int64, the chosen token of each row
    processed_logits: torch.Tensor  # [rows, vocab] fp32, the logits the choice was made from


def _apply_penalties(logits, b_req_idx, pm: ReqSamplingParamsManager, rows: Optional[torch.Tensor] = None):
    """Repetition, frequency and presence penalties of the rows ``rows`` ([n] int64, the
    rows whose request has one; None: every row); the other rows are returned unchanged."""
    sub = logits if rows is None else logits.index_select(0, rows)  # [n, vocab]
    idx = b_req_idx.long() if rows is None else b_req_idx.long().index_select(0, rows)  # [n]
    rep = pm.req_to_repetition_penalty[idx].unsqueeze(1)  # [n, 1]
    seen = pm.req_to_token_seen[idx]  # [n, vocab]
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    counts = pm.req_to_out_token_counts[idx].to(torch.float32)  # [n, vocab]
    sub = sub - pm.req_to_frequency_penalty[idx].unsqueeze(1) * counts
    sub = sub - pm.req_to_presence_penalty[idx].unsqueeze(1) * (counts > 0).to(torch.float32)
    sub = _finite(sub)  # a tiny or huge repetition penalty overflows
    return sub if rows is None else logits.index_copy(0, rows, sub)


def _apply_logit_bias(logits, row_biases: Sequence[dict]):
    rows, cols, vals = [], [], []
    for r, bias in enumerate(row_biases):
        for tok, v in bias.items():
            rows.append(r)
            cols.append(tok)
            vals.append(v)
    if rows:
        dev = logits.device
        logits = logits.clone()
        r, c = torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)
        # fp32: a bias past its range becomes +-inf, clamped with the sum
        logits[r, c] = _finite(logits[r, c] + torch.tensor(vals, device=dev))
    return logits


def apply_token_bitmask(
    logits: torch.Tensor,  # [rows, vocab] fp32
    bitmask: torch.Tensor,  # [rows, ceil(vocab / 32)] int32, bit t % 32 of word t // 32: token t allowed
) -> torch.Tensor:
    """A copy of ``logits`` whose forbidden tokens are -inf (grammar.py: the bitmask layout)."""
    rows, vocab = logits.shape
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=logits.device)  # [32]
    bits = (bitmask.to(logits.device).unsqueeze(2) >> shifts) & 1  # [rows, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab].bool()  # [rows, vocab]
    return logits.masked_fill(~allowed, float("-inf"))


def _apply_temperature(logits, temperature):
    """logits [rows, vocab] / temperature [rows, 1]. A row that would leave
    [-LOGIT_LIMIT, LOGIT_LIMIT] (a tiny temperature) is shifted by its max first: its top
    token lands on 0 and the rest below, so its draw is greedy in effect and nothing
    overflows. A grammar row (forbidden tokens at -inf) takes the same shift, which leaves its
    distribution as it is; its -inf become -LOGIT_LIMIT. Every other row is exactly logits / temperature."""
    lo, hi = torch.aminmax(logits, dim=1, keepdim=True)  # [rows, 1]
    overflows = torch.maximum(hi, -lo) / temperature > LOGIT_LIMIT  # [rows, 1]
    shift = torch.where(overflows, hi, torch.zeros_like(hi))  # [rows, 1]
    return _finite((logits - shift) / temperature)


def _top_k_top_p_filter(logits, top_k, top_p):
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, vocab]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)  # [rows, 1]
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability mass of higher-ranked tokens
    drop = (ranks >= k) | (mass_before >= top_p.unsqueeze(1))
    drop[:, 0] = False  # the top token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


def _exponential_noise(shape, device, seeds: Sequence[Optional[int]]):
    """Exp(1) noise per row; rows with a seed draw from their own generator."""
    noise = torch.empty(shape, device=device, dtype=torch.float32).exponential_()
    for r, seed in enumerate(seeds):
        if seed is not None:
            gen = torch.Generator(device=device).manual_seed(seed)
            noise[r] = torch.empty(shape[1], device=device, dtype=torch.float32).exponential_(generator=gen)
    return noise


def sample(
    logits: torch.Tensor,  # [rows, vocab] fp32
    b_req_idx: torch.Tensor,  # [rows] int32
    pm: ReqSamplingParamsManager,
    reqs: List,  # [rows] the InferReq of each row (host-side flags, no device sync)
    row_seeds: Optional[Sequence[Optional[int]]] = None,  # [rows] per-row seed for this draw
    token_bitmask: Optional[torch.Tensor] = None,  # [rows, ceil(vocab / 32)] int32: grammar rows' allowed tokens
) -> SampleOutput:
    """Forbidden tokens (``token_bitmask``) get -inf after the penalties and biases: no bias revives
    them, and the processed logits (log-probs, ASD regrets) are those under the grammar."""
    logits = logits.float()
    distinct = list({id(r): r for r in reqs}.values())  # a decode step has K + 1 rows per request
    if any(r.has_penalty for r in distinct):  # only the rows that use a penalty pay for it
        penalty_rows = [i for i, r in enumerate(reqs) if r.has_penalty]
        rows = None if len(penalty_rows) == len(reqs) else torch.tensor(penalty_rows, device=logits.device)
        logits = _apply_penalties(logits, b_req_idx, pm, rows)
    if any(r.params.logit_bias for r in distinct):
        logits = _apply_logit_bias(logits, [r.params.logit_bias for r in reqs])
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    all_greedy = all(r.params.top_k == TOP_K_GREEDY for r in distinct)
    if all_greedy:
        return SampleOutput(torch.argmax(logits, dim=-1), logits)
    idx = b_req_idx.long()
    temperature = pm.req_to_temperature[idx].clamp_min(MIN_TEMPERATURE).unsqueeze(1)  # [rows, 1]
    logits = _apply_temperature(logits, temperature)
    top_k = pm.req_to_top_k[idx]
    filtered = _top_k_top_p_filter(logits, top_k, pm.req_to_top_p[idx])
    probs = torch.softmax(filtered, dim=-1)
    seeds = row_seeds if row_seeds is not None else [None] * len(reqs)
    sampled = torch.argmax(probs / _exponential_noise(probs.shape, probs.device, seeds), dim=-1)
    greedy = torch.argmax(logits, dim=-1)
    next_ids = torch.where(top_k == TOP_K_GREEDY, greedy, sampled)
    return SampleOutput(next_ids, logits)


def token_logprobs(processed_logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log p(token) under the processed logits: [rows, vocab], [rows] -> [rows] fp32. CUDA: one pass over
    each row's logits (token_logprobs.py: no [rows, vocab] output, a row's value independent of the other
    rows); CPU: one fused log_softmax and a gather (torch.logsumexp is about six kernels)."""
    if processed_logits.is_cuda:
        return token_logprobs_triton(processed_logits, token_ids)
    return torch.log_softmax(processed_logits, dim=-1).gather(1, token_ids.long().unsqueeze(1)).squeeze(1)


def top_logprobs(processed_logits: torch.Tensor, k: int):
    """The k most likely tokens of each row under the processed logits (the distribution
    ``token_logprobs`` reads): ([rows, k] int64 ids, [rows, k] fp32 log-probs), descending."""
    values, ids = torch.topk(torch.log_softmax(processed_logits.float(), dim=-1), k, dim=-1)
    return ids, values


def max_top_logprobs(reqs) -> int:
    """The most top log-probs any of ``reqs`` asks for (host-side: no device work)."""
    return max((r.params.top_logprobs for r in reqs), default=0)
