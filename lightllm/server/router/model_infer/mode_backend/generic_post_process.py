"""sample(): penalties -> logit bias -> temperature -> greedy / top-k / top-p, per row."""
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from lightllm.common.req_manager import ReqSamplingParamsManager
from lightllm.server.core.objs.sampling_params import TOP_K_GREEDY


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [rows] int64, the chosen token of each row
    processed_logits: torch.Tensor  # [rows, vocab] fp32, the logits the choice was made from


def _apply_penalties(logits, b_req_idx, pm: ReqSamplingParamsManager):
    idx = b_req_idx.long()
    rep = pm.req_to_repetition_penalty[idx].unsqueeze(1)  # [rows, 1]
    seen = pm.req_to_token_seen[idx]  # [rows, vocab]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    counts = pm.req_to_out_token_counts[idx].to(torch.float32)  # [rows, vocab]
    logits = logits - pm.req_to_frequency_penalty[idx].unsqueeze(1) * counts
    return logits - pm.req_to_presence_penalty[idx].unsqueeze(1) * (counts > 0).to(torch.float32)


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
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] += torch.tensor(vals, device=dev)
    return logits


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
) -> SampleOutput:
    logits = logits.float()
    if any(r.has_penalty for r in reqs):
        logits = _apply_penalties(logits, b_req_idx, pm)
    if any(r.params.logit_bias for r in reqs):
        logits = _apply_logit_bias(logits, [r.params.logit_bias for r in reqs])
    all_greedy = all(r.params.top_k == TOP_K_GREEDY for r in reqs)
    if all_greedy:
        return SampleOutput(torch.argmax(logits, dim=-1), logits)
    idx = b_req_idx.long()
    logits = logits / pm.req_to_temperature[idx].unsqueeze(1)
    top_k = pm.req_to_top_k[idx]
    filtered = _top_k_top_p_filter(logits, top_k, pm.req_to_top_p[idx])
    probs = torch.softmax(filtered, dim=-1)
    seeds = row_seeds if row_seeds is not None else [None] * len(reqs)
    sampled = torch.argmax(probs / _exponential_noise(probs.shape, probs.device, seeds), dim=-1)
    greedy = torch.argmax(logits, dim=-1)
    next_ids = torch.where(top_k == TOP_K_GREEDY, greedy, sampled)
    return SampleOutput(next_ids, logits)


def token_logprobs(processed_logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log p(token) under the processed logits: [rows, vocab], [rows] -> [rows] fp32."""
    logz = torch.logsumexp(processed_logits, dim=-1)
    return processed_logits.gather(1, token_ids.long().unsqueeze(1)).squeeze(1) - logz
