"""Per-request sampling parameters, validated once at the HTTP edge."""
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

# top_k value that means "consider the whole vocabulary"
TOP_K_ALL = -1
# top_k value that means greedy decoding; sample() uses exactly this rule
TOP_K_GREEDY = 1
MAX_STOP_SEQUENCES = 16


class SamplingParamsError(ValueError):
    """A parameter a client sent is invalid; the message names the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = TOP_K_ALL
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_sequences: List[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None
    logit_bias: Dict[int, float] = field(default_factory=dict)
    asd_regret_budget: Optional[float] = None  # ASD: this request's budget (None: the server's)
    return_details: bool = False
    # Filled by the HTTP server from stop_sequences (token ids of each stop sequence)
    stop_token_ids: List[List[int]] = field(default_factory=list)

    @property
    def is_greedy(self) -> bool:
        return self.top_k == TOP_K_GREEDY

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_request(cls, params: Dict[str, Any]) -> "SamplingParams":
        """Build and validate from a request's ``parameters`` JSON object."""
        if not isinstance(params, dict):
            raise SamplingParamsError("parameters", "must be a JSON object")
        known = {f for f in cls.__dataclass_fields__ if f != "stop_token_ids"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise SamplingParamsError(unknown[0], f"unknown parameter (valid: {', '.join(sorted(known))})")
        sp = cls()
        for k, v in params.items():
            if v is not None:
                setattr(sp, k, v)
        sp.verify()
        return sp

    def verify(self) -> None:
        """Check types and ranges; greedy (do_sample=False) becomes top_k == 1."""
        def need_int(name, lo=None, hi=None):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise SamplingParamsError(name, f"must be an integer, got {v!r}")
            if lo is not None and v < lo:
                raise SamplingParamsError(name, f"must be >= {lo}, got {v}")
            if hi is not None and v > hi:
                raise SamplingParamsError(name, f"must be <= {hi}, got {v}")

        def need_float(name, lo=None, hi=None, lo_open=False):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v):
                raise SamplingParamsError(name, f"must be a finite number, got {v!r}")
            if lo is not None and (v < lo or (lo_open and v == lo)):
                raise SamplingParamsError(name, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
            if hi is not None and v > hi:
                raise SamplingParamsError(name, f"must be <= {hi}, got {v}")
            setattr(self, name, float(v))

        def need_bool(name):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"must be true or false, got {getattr(self, name)!r}")

        need_int("max_new_tokens", lo=1)
        need_bool("do_sample")
        need_bool("ignore_eos")
        need_bool("return_details")
        need_float("temperature", lo=0.0)
        need_int("top_k", lo=TOP_K_ALL)
        if self.top_k == 0:
            raise SamplingParamsError("top_k", "must be -1 (all) or >= 1, got 0")
        need_float("top_p", lo=0.0, hi=1.0, lo_open=True)
        need_float("repetition_penalty", lo=0.0, lo_open=True)
        need_float("presence_penalty", lo=-2.0, hi=2.0)
        need_float("frequency_penalty", lo=-2.0, hi=2.0)
        if self.seed is not None:
            need_int("seed", lo=0)
        if isinstance(self.stop_sequences, str):
            self.stop_sequences = [self.stop_sequences]
        if not isinstance(self.stop_sequences, list) or not all(
            isinstance(s, str) and s for s in self.stop_sequences
        ):
            raise SamplingParamsError("stop_sequences", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop_sequences) > MAX_STOP_SEQUENCES:
            raise SamplingParamsError("stop_sequences", f"at most {MAX_STOP_SEQUENCES} entries")
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError("logit_bias", "must be an object mapping token id to bias")
        bias = {}
        for k, v in self.logit_bias.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                raise SamplingParamsError("logit_bias", f"key {k!r} is not a token id") from None
            if not _is_number(v) or not math.isfinite(v):
                raise SamplingParamsError("logit_bias", f"bias for {k!r} must be a finite number")
            bias[tok] = float(v)
        self.logit_bias = bias
        if self.asd_regret_budget is not None:
            need_float("asd_regret_budget", lo=0.0)
        # greedy: LightLLM's rule, do_sample=False or temperature 0 means top_k == 1
        if not self.do_sample or self.temperature == 0.0:
            self.top_k = TOP_K_GREEDY
            self.temperature = 1.0
            self.top_p = 1.0

    def verify_vocab(self, vocab_size: int) -> None:
        for tok in self.logit_bias:
            if not 0 <= tok < vocab_size:
                raise SamplingParamsError("logit_bias", f"token id {tok} outside vocabulary [0, {vocab_size})")
