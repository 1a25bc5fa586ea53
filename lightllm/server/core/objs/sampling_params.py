"""Per-request sampling parameters, validated once at the HTTP edge.

The ranges below are what the engine can hold (its tables are int32 / float32) and what
keeps sampling finite: with them no processed logit, probability or log-prob can become
inf or NaN. docs/limits.md lists them for users.
"""
import math
import reprlib
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from lightllm.server.core.objs.response_format import ResponseFormat, ResponseFormatError, parse_response_format
from lightllm.utils.numbers import is_number

# top_k value that means "consider the whole vocabulary"
TOP_K_ALL = -1
# top_k value that means greedy decoding; sample() uses exactly this rule
TOP_K_GREEDY = 1
MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 1024  # each stop string; streams hold back at most this much text

INT32_MAX = 2**31 - 1  # top_k, max_new_tokens and token ids live in int32 tables
INT64_MAX = 2**63 - 1
# A sampled token's seed is the request's seed + its output position (< INT32_MAX): the sum
# must stay an int64.
MAX_SEED = INT64_MAX - INT32_MAX
# Sampled requests divide logits by the temperature. Below the minimum sampling is greedy
# in all but name (and 1e-50 rounds to 0 in fp32: a division by zero, NaN log-probs); above
# the maximum the distribution is flat. With these bounds and the penalty and bias bounds
# below, |processed logit| <= 1e4 * (|logit| + 100 + 2 * output tokens): far inside fp32.
MIN_SAMPLING_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 1e2
# repetition_penalty divides (or multiplies) the logits of seen tokens: same reasoning
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2
MAX_ABS_PRESENCE_PENALTY = 2.0  # OpenAI's range
MAX_ABS_FREQUENCY_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range; +-100 already forces or bans a token
MAX_LOGIT_BIAS_ENTRIES = 1024  # biases are applied per row per step on the host
MAX_ASD_REGRET_BUDGET = 1e6  # stored in fp32; far above any useful budget
# Most top log-probs a request may ask for per token (OpenAI's chat bound; vLLM's default
# max_logprobs): the decode step keeps the top-k of a step's rows only when one asks.
MAX_TOP_LOGPROBS = 20

# How much of a bad value an error message quotes
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlist, _QUOTE.maxdict = 2, 40, 40, 4, 4


class SamplingParamsError(ValueError):
    """A parameter a client sent is invalid; the message names the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name
        self.message = message  # without the field (a client's field name may hold ": " too)


def _is_finite_number(v: Any) -> bool:
    """A JSON number that is finite as a float (a 400-digit integer is not)."""
    if not is_number(v):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def quote(v: Any) -> str:
    """A short repr of a client's value for an error message (bounded, never recursing deep)."""
    return _QUOTE.repr(v)


def is_utf8_text(s: str) -> bool:
    """False for strings UTF-8 cannot encode (lone surrogates such as JSON's "\\ud800")."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class SamplingParams:
    """A request's parameters, validated and normalised once, at construction; frozen after.

    Normalised: numbers become floats, a single stop string a list, logit_bias keys ints,
    and greedy requests (do_sample=False or temperature 0) get top_k == 1, temperature
    and top_p 1 (LightLLM's rule). Build a changed copy with ``dataclasses.replace``.
    """

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
    # the most likely alternatives (token id, log-prob) to return for every generated token
    top_logprobs: int = 0
    return_details: bool = False
    # JSON output (docs/structured_output.md): the client's {"type": ...} object, parsed to a
    # ResponseFormat (None: text)
    response_format: Optional[ResponseFormat] = None
    # Token ids of each stop sequence, set by the HTTP server (clients cannot send them)
    stop_token_ids: List[List[int]] = field(default_factory=list)

    def __post_init__(self):
        self._validate()

    def _set(self, name: str, value: Any) -> None:
        """Normalise a field during construction (the only writes a frozen instance gets)."""
        object.__setattr__(self, name, value)

    @property
    def is_greedy(self) -> bool:
        return self.top_k == TOP_K_GREEDY

    def asd_budget(self, server_budget: Optional[float]) -> float:
        """The ASD budget this request runs with: its own, else the server's (``server_budget``,
        None without ASD). Sampled requests and servers without ASD verify strictly (0)."""
        if server_budget is None or not self.is_greedy:
            return 0.0
        return self.asd_regret_budget if self.asd_regret_budget is not None else server_budget

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_request(cls, params: Dict[str, Any]) -> "SamplingParams":
        """Build and validate from a request's ``parameters`` JSON object (null means the default)."""
        if not isinstance(params, dict):
            raise SamplingParamsError("parameters", "must be a JSON object")
        known = {f for f in cls.__dataclass_fields__ if f != "stop_token_ids"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise SamplingParamsError(unknown[0], f"unknown parameter (valid: {', '.join(sorted(known))})")
        return cls(**{k: v for k, v in params.items() if v is not None})

    def _validate(self) -> None:
        """Check types and ranges (the module constants), then normalise (see the class docstring)."""
        def need_int(name, lo=None, hi=None):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise SamplingParamsError(name, f"must be an integer, got {quote(v)}")
            if lo is not None and v < lo:
                raise SamplingParamsError(name, f"must be >= {lo}, got {quote(v)}")
            if hi is not None and v > hi:
                raise SamplingParamsError(name, f"must be <= {hi}, got {quote(v)}")

        def need_float(name, lo=None, hi=None, lo_open=False):
            v = getattr(self, name)
            if not _is_finite_number(v):
                raise SamplingParamsError(name, f"must be a finite number, got {quote(v)}")
            if lo is not None and (v < lo or (lo_open and v == lo)):
                raise SamplingParamsError(name, f"must be {'>' if lo_open else '>='} {lo}, got {quote(v)}")
            if hi is not None and v > hi:
                raise SamplingParamsError(name, f"must be <= {hi}, got {quote(v)}")
            self._set(name, float(v))

        def need_bool(name):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"must be true or false, got {quote(getattr(self, name))}")

        need_int("max_new_tokens", lo=1, hi=INT32_MAX)
        need_int("top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
        need_bool("do_sample")
        need_bool("ignore_eos")
        need_bool("return_details")
        need_float("temperature", lo=0.0, hi=MAX_TEMPERATURE)
        if self.do_sample and 0.0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            raise SamplingParamsError(
                "temperature", f"must be 0 (greedy) or >= {MIN_SAMPLING_TEMPERATURE} when sampling, got {self.temperature}"
            )
        need_int("top_k", lo=TOP_K_ALL, hi=INT32_MAX)
        if self.top_k == 0:
            raise SamplingParamsError("top_k", "must be -1 (all) or >= 1, got 0")
        need_float("top_p", lo=0.0, hi=1.0, lo_open=True)
        need_float("repetition_penalty", lo=MIN_REPETITION_PENALTY, hi=MAX_REPETITION_PENALTY)
        need_float("presence_penalty", lo=-MAX_ABS_PRESENCE_PENALTY, hi=MAX_ABS_PRESENCE_PENALTY)
        need_float("frequency_penalty", lo=-MAX_ABS_FREQUENCY_PENALTY, hi=MAX_ABS_FREQUENCY_PENALTY)
        if self.seed is not None:
            need_int("seed", lo=0, hi=MAX_SEED)
        self._verify_stop_sequences()
        self._verify_logit_bias()
        try:
            self._set("response_format", parse_response_format(self.response_format))
        except ResponseFormatError as e:
            raise SamplingParamsError("response_format", str(e)) from None
        if self.asd_regret_budget is not None:
            need_float("asd_regret_budget", lo=0.0, hi=MAX_ASD_REGRET_BUDGET)
        # greedy: LightLLM's rule, do_sample=False or temperature 0 means top_k == 1
        if not self.do_sample or self.temperature == 0.0:
            self._set("top_k", TOP_K_GREEDY)
            self._set("temperature", 1.0)
            self._set("top_p", 1.0)

    def _verify_stop_sequences(self) -> None:
        if isinstance(self.stop_sequences, str):
            self._set("stop_sequences", [self.stop_sequences])
        if not isinstance(self.stop_sequences, list) or not all(
            isinstance(s, str) and s for s in self.stop_sequences
        ):
            raise SamplingParamsError("stop_sequences", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop_sequences) > MAX_STOP_SEQUENCES:
            raise SamplingParamsError("stop_sequences", f"at most {MAX_STOP_SEQUENCES} entries")
        for s in self.stop_sequences:
            if len(s) > MAX_STOP_SEQUENCE_CHARS:
                raise SamplingParamsError("stop_sequences", f"each at most {MAX_STOP_SEQUENCE_CHARS} characters")
            if not is_utf8_text(s):
                raise SamplingParamsError("stop_sequences", "is not valid Unicode (a lone surrogate)")

    def _verify_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError("logit_bias", "must be an object mapping token id to bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        bias = {}
        for k, v in self.logit_bias.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                raise SamplingParamsError("logit_bias", f"key {quote(k)} is not a token id") from None
            if not 0 <= tok <= INT32_MAX:
                raise SamplingParamsError("logit_bias", f"token id {quote(k)} is not in [0, {INT32_MAX}]")
            if not _is_finite_number(v) or abs(v) > MAX_ABS_LOGIT_BIAS:
                raise SamplingParamsError(
                    "logit_bias", f"bias for {quote(k)} must be a number in [-{MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}]"
                )
            bias[tok] = float(v)
        self._set("logit_bias", bias)

    def verify_vocab(self, vocab_size: int) -> None:
        for tok in self.logit_bias:
            if not 0 <= tok < vocab_size:
                raise SamplingParamsError("logit_bias", f"token id {tok} outside vocabulary [0, {vocab_size})")
