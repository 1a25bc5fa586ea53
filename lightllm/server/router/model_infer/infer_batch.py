"""Request state inside the model worker."""
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, List, Optional

from lightllm.server.core.objs.sampling_params import SamplingParams


class FinishReason:
    EOS = "eos"  # the model's eos token
    STOP = "stop"  # a stop sequence
    LENGTH = "length"  # max_new_tokens
    ABORT = "abort"  # client went away
    ERROR = "error"  # the worker could not serve it (InferReq.error / ReqStepUpdate.error say why)


@dataclass
class InferReq:
    req_id: int
    prompt_ids: List[int]
    params: SamplingParams
    eos_token_ids: List[int]
    asd_budget: float = 0.0  # 0 for sampled requests (they are verified strictly)
    dp_rank: int = 0  # the DP group that runs it (set at admission); others keep a shadow copy
    req_idx: int = -1  # -1: no table row on this rank (not admitted yet, freed, or another DP group's)
    kv_len: int = 0  # positions whose KV is in the target cache
    slots: List[int] = field(default_factory=list)  # KV slot of each cached position
    output_ids: List[int] = field(default_factory=list)
    output_logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None  # why the worker failed it (finish_reason ERROR), for the client
    # MTP / ASD counters reported in the response
    mtp_accepted_token_num: int = 0
    asd_relaxed_token_num: int = 0
    asd_regret_spent: float = 0.0
    decode_steps: int = 0
    # the router's time.monotonic() when it received the request, and the seconds it then waited
    # for admission (set by RouterManager._admit; ReqStepUpdate.queue_time_s)
    queued_at: float = field(default_factory=time.monotonic, compare=False, repr=False)
    queue_time_s: Optional[float] = field(default=None, compare=False)
    kv_reserved: int = 0  # KV slots the admission queue reserved for it (ReqQueue.release gives them back)
    # The prompt cache (prompt_cache.py): the first prompt_cached_len positions use the slots of the
    # locked match ``prefix`` (a PrefixMatch); ``slots`` are the positions after them.
    prompt_cached_len: int = 0
    prefix: Optional[Any] = field(default=None, compare=False, repr=False)
    # JSON output: the request's grammar.RequestGrammar (set at admission by the backend that runs it;
    # None: no response_format, or another DP group's request)
    grammar: Optional[Any] = field(default=None, compare=False, repr=False)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        return self.kv_len < self.prompt_len

    @cached_property  # a request's sampling parameters never change
    def has_penalty(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def append_token(self, token_id: int, logprob: float) -> bool:
        """Commit one generated token; True when the request is finished after it. With a grammar the
        token goes into its matcher too, and the grammar's end (its stop token) finishes with STOP."""
        self.output_ids.append(token_id)
        self.output_logprobs.append(logprob)
        p = self.params
        if self.grammar is not None and not self.grammar.accept(token_id):  # masked choices never are
            self.finish_reason = FinishReason.ERROR
            self.error = f"the grammar refused token {token_id}"
        elif self.grammar is not None and self.grammar.terminated:
            self.finish_reason = FinishReason.STOP
        elif not p.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason = FinishReason.EOS
        elif any(
            len(s) <= len(self.output_ids) and self.output_ids[-len(s):] == s for s in p.stop_token_ids
        ):
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= p.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None

    def append_tokens(self, ids: List[int], logprobs: List[float]) -> int:
        """Commit ``ids`` in order until one finishes the request; returns how many were kept.
        The same as ``append_token`` per token; without a grammar or stop sequences, one pass
        finds where EOS or max_new_tokens ends it."""
        p = self.params
        if self.grammar is not None or p.stop_token_ids:
            for j in range(len(ids)):
                if self.append_token(ids[j], logprobs[j]):
                    return j + 1
            return len(ids)
        n = min(len(ids), max(1, p.max_new_tokens - len(self.output_ids)))
        reason = FinishReason.LENGTH if len(self.output_ids) + n >= p.max_new_tokens else None
        if not p.ignore_eos:
            eos = self.eos_token_ids
            for j in range(n):
                if ids[j] in eos:  # EOS wins over the length limit at the same token
                    n, reason = j + 1, FinishReason.EOS
                    break
        self.output_ids.extend(ids[:n])
        self.output_logprobs.extend(logprobs[:n])
        self.finish_reason = reason
        return n
