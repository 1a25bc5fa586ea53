"""General training prompts without a dataset: ask the target model for user turns.

Magpie (Xu et al. 2024, arXiv:2406.08464): an instruction-tuned model given its chat
template's text up to where a user message begins writes a plausible user message.
Sampled at a moderate temperature these are varied prompts; the target then answers
them (train_mtp_draft.py).

Domains (``MAGPIE_DOMAINS``): the paper steers what users ask with a system prompt. A run
splits its count into equal shares over ``MagpieConfig.domains`` and samples each share under
its domain's system prompt; ``default`` keeps the template's own system turn.

Vocabulary:
  user-turn prefix  the template's text up to a user message's first character, found by
                    rendering a sentinel message (``user_turn_prefix``)
  end of turn       the template's marker right after a user message: the stop sequence
  raw turn          one sampled user message, and whether it reached the end of turn
  domain            a name in MAGPIE_DOMAINS: the system prompt a user turn was sampled under
  prompt record     {"kind", "source", "prompt"} (+ "domain" for Magpie): one line of a prompt-set JSONL file

Seeds (``MagpieConfig.seed_mode``): ``request`` gives every request its own seed, so its
text does not depend on its batch (the engine then seeds a generator per row per step);
``batch`` seeds the generators once per round: repeatable on the same device and batch
size, and free (in-process engine only, --tp 1).
"""
import dataclasses
import gzip
import json
import logging
import math
import os
import random
import re
import time
import unicodedata
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from lightllm.tools.client import free_device_memory
from lightllm.tools.prompts import REPO

logger = logging.getLogger(__name__)

# A user message no template rewrites (letters and digits only: survives `| trim`, escaping)
SENTINEL = "MagpieSentinel7f3a9cUserTurn"
# Request i of a run draws with seeds (offset(run seed) + i * SEED_STRIDE + position) mod 2**SEED_BITS:
# disjoint across a run's requests (position < SEED_STRIDE, i < MAX_REQUESTS_PER_RUN). 32 bits,
# because CPU generators (mt19937) keep only a seed's low 32 bits.
SEED_BITS = 32
SEED_STRIDE = 1 << 10
MAX_REQUESTS_PER_RUN = 1 << (SEED_BITS - 10)
SEED_MODES = ("request", "batch")
GEN_BATCH_MAX_TOKENS = 8192  # prompt tokens per prefill step

# Tags in the style of <|im_start|>, <|eot_id|>, <|user|>: never part of a real user message
GENERIC_TAG_PATTERN = re.compile(r"<\|[^<>|\s]{1,40}\|>")
ENDED_FINISH_REASONS = ("eos", "stop")  # the engine's finish reasons that mean "reached the end of turn"

# prompt kinds and sources of a prompt set
KIND_GENERAL = "general"
KIND_MATH = "math"
SOURCE_MAGPIE = "magpie"
SOURCE_GSM8K = "gsm8k_train"
PROMPT_RECORD_KEYS = ("kind", "source", "prompt")  # required; "domain" is optional

# Magpie domains: name -> the system prompt its user turns are sampled under (None: the template's own)
DEFAULT_DOMAIN = "default"
MAGPIE_DOMAINS: Dict[str, Optional[str]] = {
    DEFAULT_DOMAIN: None,
    "code": "You are a programming assistant. Users ask you to write, complete, explain or fix code "
            "in Python, shell, SQL or JavaScript.",
    "writing": "You are a writing assistant. Users ask you to write emails, stories and summaries, "
               "or to rewrite their text.",
    "advice": "You are a helpful assistant who gives practical advice. Users ask you how to plan, "
              "decide or get everyday things done.",
    "explanation": "You are a knowledgeable teacher. Users ask you to explain concepts in science, "
                   "history and technology.",
}

# the held-out set (benchmarks/data/README.md): never used for training
DEFAULT_HELDOUT_PATH = os.path.join(REPO, "benchmarks", "data", "heldout_prompts.jsonl")


@dataclass(frozen=True)
class UserTurnPrefix:
    text: str  # the template's text up to where a user message begins
    end_of_turn: str  # the marker right after a user message (the stop sequence)
    end_of_turn_ids: Tuple[int, ...]
    tags: Tuple[str, ...]  # strings no clean user message contains (special tokens, turn markers)


def render_with_sentinel(tokenizer, system_prompt: Optional[str] = None) -> str:
    """The chat template over one user turn whose content is SENTINEL (no generation prompt)."""
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages.append({"role": "user", "content": SENTINEL})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if text.count(SENTINEL) != 1:
        raise ValueError(f"the chat template rendered the user message {text.count(SENTINEL)} times, expected once")
    return text


def special_token_strings(tokenizer) -> List[str]:
    """The tokenizer's special and added tokens, longest first."""
    tokens = set(getattr(tokenizer, "all_special_tokens", []) or [])
    if hasattr(tokenizer, "get_added_vocab"):
        tokens.update(tokenizer.get_added_vocab())
    return sorted((t for t in tokens if t and t.strip()), key=lambda t: (-len(t), t))


def end_of_turn_marker(suffix: str, specials: Sequence[str]) -> str:
    """The leading special token of the text after a user message, else its first line."""
    stripped = suffix.strip()
    for tok in specials:
        if stripped.startswith(tok):
            return tok
    line = stripped.split("\n", 1)[0].strip()
    if not line:
        raise ValueError(f"the chat template ends a user message with nothing to stop at: {suffix!r}")
    return line


def user_turn_prefix(tokenizer, system_prompt: Optional[str] = None) -> UserTurnPrefix:
    """The prefix, end-of-turn marker and tags of ``tokenizer``'s chat template; ``system_prompt``
    None keeps the system turn the template renders by default (SmolLM2 renders one)."""
    prefix, suffix = render_with_sentinel(tokenizer, system_prompt).split(SENTINEL)
    specials = special_token_strings(tokenizer)
    eot = end_of_turn_marker(suffix, specials)
    header = prefix.rsplit(eot, 1)[-1].strip()  # the user header: after the previous turn's end
    tags = tuple(dict.fromkeys([*specials, eot] + ([header] if header else [])))
    return UserTurnPrefix(prefix, eot, tuple(tokenizer.encode(eot, add_special_tokens=False)), tags)


@dataclass(frozen=True)
class FilterConfig:
    min_chars: int = 12  # after stripping
    min_words: int = 3
    max_chars: int = 2000  # a turn that ended but is still this long is dropped too

    def __post_init__(self):
        if not (0 <= self.min_chars <= self.max_chars and self.min_words >= 0):
            raise ValueError("need 0 <= min_chars <= max_chars and min_words >= 0")


@dataclass(frozen=True)
class RawTurn:
    text: str  # decoded with special tokens kept, end-of-turn marker removed
    ended: bool  # reached the end of turn (False: max_new_tokens or the time budget)


# why a raw turn was dropped (FilterResult.dropped keys), in the order they are checked
DROP_REASONS = DROP_OVERLONG, DROP_EMPTY, DROP_TAG, DROP_SHORT, DROP_LONG, DROP_DUPLICATE = (
    "overlong", "empty", "template_tag", "too_short", "too_long", "duplicate")


@dataclass
class FilterResult:
    kept: List[str]  # cleaned prompts, in input order
    dropped: Dict[str, int] = field(default_factory=lambda: {r: 0 for r in DROP_REASONS})


def normalize_prompt(text: str) -> str:
    """The key of duplicate and held-out checks: NFKC, case-folded, punctuation dropped, spaces collapsed."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(re.sub(r"[\W_]+", " ", text).split())


def has_template_tag(text: str, tags: Sequence[str]) -> bool:
    return any(t in text for t in tags) or GENERIC_TAG_PATTERN.search(text) is not None


def drop_reason(turn: RawTurn, tags: Sequence[str], cfg: FilterConfig) -> Optional[str]:
    """Why one raw turn is unusable on its own (duplicates aside), or None."""
    text = turn.text.strip()
    if not turn.ended:
        return DROP_OVERLONG
    if not text:
        return DROP_EMPTY
    if has_template_tag(text, tags):
        return DROP_TAG
    if len(text) < cfg.min_chars or len(text.split()) < cfg.min_words:
        return DROP_SHORT
    return DROP_LONG if len(text) > cfg.max_chars else None


def filter_user_turns(turns: Sequence[RawTurn], tags: Sequence[str], cfg: FilterConfig = FilterConfig(),
                      seen: Sequence[str] = ()) -> FilterResult:
    """The stripped turns that pass ``drop_reason`` and are new (not in ``seen``, normalised keys)."""
    result = FilterResult(kept=[])
    keys = set(seen)
    for turn in turns:
        reason = drop_reason(turn, tags, cfg)
        key = normalize_prompt(turn.text)
        if reason is None and key in keys:
            reason = DROP_DUPLICATE
        if reason is not None:
            result.dropped[reason] += 1
            continue
        keys.add(key)
        result.kept.append(turn.text.strip())
    return result


@dataclass(frozen=True)
class MagpieConfig:
    count: int = 256  # prompts wanted after filtering
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = -1  # -1: the whole vocabulary
    max_new_tokens: int = 96  # a user turn longer than this is dropped as overlong
    seed: int = 0
    seed_mode: str = "request"  # a name in SEED_MODES
    system_prompt: Optional[str] = None  # the default domain's (None: the template's default system turn)
    domains: Tuple[str, ...] = (DEFAULT_DOMAIN,)  # names in MAGPIE_DOMAINS: count is split over them
    oversample: float = 1.6  # requests per wanted prompt in the first round (filtering drops some)
    max_rounds: int = 8  # sampling rounds before giving up on reaching count
    gen_batch_size: int = 256  # the engine's running_max_req_size: requests decoded together
    max_seconds: Optional[float] = None  # time budget: no round starts after it, unfinished turns are aborted
    filter: FilterConfig = FilterConfig()

    def __post_init__(self):
        if self.count < 1 or self.max_rounds < 1 or self.gen_batch_size < 1:
            raise ValueError("count, max_rounds and gen_batch_size must be >= 1")
        if not (0 < self.temperature and 0 < self.top_p <= 1 and self.oversample >= 1):
            raise ValueError("need temperature > 0, top_p in (0, 1], oversample >= 1")
        if not 1 <= self.max_new_tokens < SEED_STRIDE:
            raise ValueError(f"max_new_tokens must be in [1, {SEED_STRIDE})")
        if self.seed < 0:
            raise ValueError("seed must be >= 0")
        if self.seed_mode not in SEED_MODES:
            raise ValueError(f"seed_mode {self.seed_mode!r}; valid names: {', '.join(SEED_MODES)}")
        check_domains(self.domains)

    def domain_system_prompt(self, domain: str) -> Optional[str]:
        """The system prompt ``domain``'s user turns are sampled under (None: the template's default)."""
        return self.system_prompt if domain == DEFAULT_DOMAIN else MAGPIE_DOMAINS[domain]

    def sampling_params(self, request_index: int) -> Dict:
        """The engine's request parameters of request ``request_index`` (0-based over the run)."""
        params = {"max_new_tokens": self.max_new_tokens, "do_sample": True, "temperature": self.temperature,
                  "top_p": self.top_p, "top_k": self.top_k}
        if self.seed_mode == "request":
            params["seed"] = request_seed(self.seed, request_index)
        return params


def check_domains(domains: Sequence[str]) -> None:
    """ValueError unless ``domains`` is a non-empty list of distinct names in MAGPIE_DOMAINS."""
    if isinstance(domains, str):
        raise ValueError(f"domains is a sequence of names, not the string {domains!r} (see parse_domains)")
    unknown = [d for d in domains if d not in MAGPIE_DOMAINS]
    if unknown:
        raise ValueError(f"unknown Magpie domain(s) {', '.join(map(repr, unknown))}; "
                         f"valid names: {', '.join(MAGPIE_DOMAINS)}")
    if not domains or len(set(domains)) != len(domains):
        raise ValueError(f"Magpie domains must be distinct and at least one, got {list(domains)}")


def parse_domains(text: str) -> Tuple[str, ...]:
    """Comma-separated domain names (spaces around them ignored), checked with ``check_domains``."""
    domains = tuple(d.strip() for d in text.split(","))
    check_domains(domains)
    return domains


def domain_counts(count: int, num_domains: int) -> List[int]:
    """``count`` split into ``num_domains`` equal shares, the remainder one each to the first shares."""
    share, rest = divmod(count, num_domains)
    return [share + (1 if i < rest else 0) for i in range(num_domains)]


def domain_deadlines(start: float, max_seconds: Optional[float], counts: Sequence[int]) -> List[Optional[float]]:
    """Each share's deadline: the time budget split by counts, time a share leaves passes to the next."""
    if max_seconds is None:
        return [None] * len(counts)
    total, done, deadlines = sum(counts), 0, []
    for c in counts:
        done += c
        deadlines.append(start + max_seconds * (done / total))
    return deadlines


def domain_prefixes(tokenizer, cfg: MagpieConfig) -> Dict[str, UserTurnPrefix]:
    """The user-turn prefix of every domain of ``cfg``, in its order."""
    return {d: user_turn_prefix(tokenizer, cfg.domain_system_prompt(d)) for d in cfg.domains}


def request_seed(run_seed: int, request_index: int) -> int:
    """One request's engine seed: no draw shares a seed with another request of the run."""
    if not 0 <= request_index < MAX_REQUESTS_PER_RUN:
        raise ValueError(f"request_index must be in [0, {MAX_REQUESTS_PER_RUN})")
    offset = random.Random(run_seed).getrandbits(SEED_BITS)
    return (offset + request_index * SEED_STRIDE) % (1 << SEED_BITS)


def abort_all_after(deadline: Optional[float]) -> Optional[Callable]:
    """An engine ``on_step`` callback that aborts every unfinished request once ``time.monotonic()``
    passes ``deadline`` (None: no callback)."""
    if deadline is None:
        return None

    def on_step(router) -> None:
        if time.monotonic() > deadline:
            for req in list(router.running) + list(router.queue.waiting):
                router.abort(req.req_id)

    return on_step


def strip_end_of_turn(token_ids: Sequence[int], end_of_turn_ids: Sequence[int],
                      eos_token_ids: Sequence[int]) -> List[int]:
    """Token ids without the trailing end-of-turn marker or eos token the engine stopped at."""
    ids, n = list(token_ids), len(end_of_turn_ids)
    if n and ids[-n:] == list(end_of_turn_ids):
        return ids[:-n]
    return ids[:-1] if ids and ids[-1] in eos_token_ids else ids


def sample_user_turns(engine, tokenizer, prefix: UserTurnPrefix, cfg: MagpieConfig, first_index: int, n: int,
                      eos_token_ids: Sequence[int], progress: bool = False, on_step=None) -> List[RawTurn]:
    """Requests first_index .. first_index + n - 1 of the run: the prefix, sampled to the end of turn."""
    from lightllm.server.core.objs.sampling_params import SamplingParams

    prefix_ids = tokenizer.encode(prefix.text, add_special_tokens=False)  # the template carries its own BOS
    if cfg.seed_mode == "batch":
        import torch

        torch.manual_seed(request_seed(cfg.seed, first_index))  # every device's generator, once per round
    stop = [list(prefix.end_of_turn_ids)]
    params = [dataclasses.replace(SamplingParams.from_request(cfg.sampling_params(i)), stop_token_ids=stop)
              for i in range(first_index, first_index + n)]
    results = engine.generate([prefix_ids] * n, params, eos_token_ids=list(eos_token_ids), progress=progress,
                              on_step=on_step)
    turns = []
    for r in results:
        if r.finish_reason == "error":
            raise RuntimeError(f"the engine failed a request: {r.error}")
        text = tokenizer.decode(strip_end_of_turn(r.token_ids, prefix.end_of_turn_ids, eos_token_ids),
                                skip_special_tokens=False)
        ended = r.finish_reason in ENDED_FINISH_REASONS
        if prefix.end_of_turn in text:  # a plain-text marker tokenised otherwise in context than alone
            text, ended = text.split(prefix.end_of_turn, 1)[0], True
        turns.append(RawTurn(text, ended))
    return turns


@dataclass(frozen=True)
class DomainShare:
    """One domain's part of a run."""

    domain: str
    system_prompt: Optional[str]  # None: the template's default system turn
    wanted: int  # its share of MagpieConfig.count
    prompts: int  # kept (at most wanted)
    requests: int
    rounds: int


@dataclass
class MagpieResult:
    prompts: List[str]  # exactly cfg.count unless max_rounds or the time budget ran out
    requests: int  # user turns sampled in all
    rounds: int
    dropped: Dict[str, int]  # by reason, over all rounds
    seconds: float
    prefix: UserTurnPrefix  # the first domain's (every domain's has the same tags)
    domains: Optional[List[str]] = None  # each prompt's domain (None: all DEFAULT_DOMAIN)
    shares: List[DomainShare] = field(default_factory=list)  # per domain, in sampling order

    def __post_init__(self):
        if self.domains is None:
            self.domains = [DEFAULT_DOMAIN] * len(self.prompts)
        if len(self.domains) != len(self.prompts):
            raise ValueError(f"{len(self.domains)} domains for {len(self.prompts)} prompts")

    def records(self) -> List["PromptRecord"]:
        return as_records(self.prompts, KIND_GENERAL, SOURCE_MAGPIE, self.domains)

    def stats(self) -> Dict:
        """What training_info.json records: counts and time, not the prompts."""
        return {"prompts": len(self.prompts), "requests": self.requests, "rounds": self.rounds,
                "dropped": dict(self.dropped), "seconds": self.seconds,
                "domains": [s.domain for s in self.shares],
                "by_domain": {s.domain: {k: v for k, v in asdict(s).items() if k != "domain"} for s in self.shares}}


@dataclass
class _ShareResult:
    kept: List[str]
    dropped: Dict[str, int]
    requests: int
    rounds: int


def _collect_share(engine, tokenizer, prefix: UserTurnPrefix, cfg: MagpieConfig, count: int, first_index: int,
                   seen: Sequence[str], deadline: Optional[float], eos_token_ids: Sequence[int],
                   progress: bool) -> _ShareResult:
    """Rounds of user turns under ``prefix`` (requests from ``first_index`` on) until ``count`` new ones
    survive the filter (``seen``: normalised prompts kept before), max_rounds or ``deadline``."""
    kept: List[str] = []
    dropped = {r: 0 for r in DROP_REASONS}
    requests = rounds = 0
    while len(kept) < count and rounds < cfg.max_rounds and (deadline is None or time.monotonic() < deadline):
        # later rounds ask for the missing share at the yield seen so far (at least the oversample rate)
        rate = max(cfg.oversample, requests / len(kept)) if kept else cfg.oversample * (2 ** rounds)
        n = min(MAX_REQUESTS_PER_RUN - first_index - requests, math.ceil((count - len(kept)) * rate))
        if n == 0:
            break
        turns = sample_user_turns(engine, tokenizer, prefix, cfg, first_index + requests, n, eos_token_ids, progress,
                                  abort_all_after(deadline))
        got = filter_user_turns(turns, prefix.tags, cfg.filter, seen=[*seen, *(normalize_prompt(p) for p in kept)])
        kept.extend(got.kept)
        for r, c in got.dropped.items():
            dropped[r] += c
        requests += n
        rounds += 1
    return _ShareResult(kept[:count], dropped, requests, rounds)


def collect_prompts(engine, tokenizer, prefix: Union[UserTurnPrefix, Mapping[str, UserTurnPrefix]],
                    cfg: MagpieConfig, eos_token_ids: Sequence[int], progress: bool = False) -> MagpieResult:
    """``cfg.count`` prompts split over ``cfg.domains`` (``domain_counts``), each share sampled in rounds under
    its domain's prefix (``prefix``: one per domain, or one for all) until it survives the filter (no
    duplicates across domains), ``cfg.max_rounds`` or its part of the time budget ran out. Request
    indices (and so seeds) run on across the domains."""
    prefixes = prefix if isinstance(prefix, Mapping) else {d: prefix for d in cfg.domains}
    start = time.monotonic()
    counts = domain_counts(cfg.count, len(cfg.domains))
    deadlines = domain_deadlines(start, cfg.max_seconds, counts)
    kept: List[str] = []
    domains: List[str] = []
    shares: List[DomainShare] = []
    dropped = {r: 0 for r in DROP_REASONS}
    requests = rounds = 0
    for domain, count, deadline in zip(cfg.domains, counts, deadlines):
        got = _ShareResult([], {}, 0, 0)
        if count:
            got = _collect_share(engine, tokenizer, prefixes[domain], cfg, count, requests,
                                 [normalize_prompt(p) for p in kept], deadline, eos_token_ids, progress)
        if len(got.kept) < count:
            logger.warning("magpie: %d of %d %s prompts after %d rounds", len(got.kept), count, domain, got.rounds)
        kept.extend(got.kept)
        domains.extend([domain] * len(got.kept))
        for r, c in got.dropped.items():
            dropped[r] += c
        requests += got.requests
        rounds += got.rounds
        shares.append(DomainShare(domain, cfg.domain_system_prompt(domain), count, len(got.kept), got.requests,
                                  got.rounds))
    return MagpieResult(kept, requests, rounds, dropped, time.monotonic() - start, prefixes[cfg.domains[0]],
                        domains, shares)


def generate_magpie_prompts(model_dir: str, cfg: MagpieConfig, device: Optional[str] = None,
                            dtype: Optional[str] = None, progress: bool = False, tokenizer=None) -> MagpieResult:
    """``cfg.count`` user prompts written by the model in ``model_dir`` over ``cfg.domains`` (one OfflineEngine,
    freed after)."""
    from transformers import AutoTokenizer

    from lightllm.server.core.objs.start_args_type import StartArgs
    from lightllm.server.offline_engine import OfflineEngine

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    prefixes = domain_prefixes(tokenizer, cfg)
    max_len = max(len(tokenizer.encode(p.text, add_special_tokens=False)) for p in prefixes.values())
    max_len += cfg.max_new_tokens
    args = StartArgs(model_dir=model_dir, running_max_req_size=cfg.gen_batch_size, max_req_total_len=max_len,
                     batch_max_tokens=max(GEN_BATCH_MAX_TOKENS, max_len))
    engine = OfflineEngine(args, device=device, dtype=dtype)
    try:
        return collect_prompts(engine, tokenizer, prefixes, cfg, engine.eos_token_ids(), progress)
    finally:
        engine.close()
        del engine  # its KV pool goes before the caller loads another model
        free_device_memory()


@dataclass(frozen=True)
class PromptRecord:
    kind: str  # KIND_GENERAL, KIND_MATH, or a held-out kind
    source: str  # SOURCE_MAGPIE, SOURCE_GSM8K, ...
    prompt: str
    domain: Optional[str] = None  # a Magpie prompt's domain (MAGPIE_DOMAINS); None for other sources

    def as_json(self) -> Dict[str, str]:
        """Its prompt-set line's object: "domain" only when set."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def as_records(prompts: Sequence[str], kind: str, source: str,
               domains: Optional[Sequence[str]] = None) -> List[PromptRecord]:
    """Records of ``prompts``; ``domains``: each prompt's domain (None: no domain)."""
    domains = [None] * len(prompts) if domains is None else domains
    if len(domains) != len(prompts):
        raise ValueError(f"{len(domains)} domains for {len(prompts)} prompts")
    return [PromptRecord(kind, source, p, d) for p, d in zip(prompts, domains)]


def write_prompt_set(path: str, records: Sequence[PromptRecord]) -> None:
    """One {"kind", "source", "prompt"} (+ "domain") JSON object per line (UTF-8)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r.as_json(), ensure_ascii=False) + "\n" for r in records)


def read_prompt_set(path: str) -> List[PromptRecord]:
    """The records of a prompt-set file (gzipped when it ends in .gz), in order (extra keys ignored,
    a missing key is an error, "domain" is optional)."""
    records = []
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            missing = [k for k in PROMPT_RECORD_KEYS if not isinstance(obj.get(k), str)]
            if not isinstance(obj.get("domain"), (str, type(None))):  # optional
                missing.append("domain")
            if missing:
                raise ValueError(f"{path}:{lineno}: missing or non-string {', '.join(missing)}")
            records.append(PromptRecord(obj["kind"], obj["source"], obj["prompt"], obj.get("domain")))
    return records


def mix_counts(num_general: int, num_gsm8k: int, gsm8k_fraction: float, n: Optional[int]) -> Tuple[int, int]:
    """(general, gsm8k) counts of a mixture of ``n`` prompts (None: the largest the pools allow)."""
    if not 0.0 <= gsm8k_fraction <= 1.0:
        raise ValueError(f"gsm8k_fraction must be in [0, 1], got {gsm8k_fraction}")
    if n is None:
        limits = [num_general / (1.0 - gsm8k_fraction)] if gsm8k_fraction < 1.0 else []
        limits += [num_gsm8k / gsm8k_fraction] if gsm8k_fraction > 0.0 else []
        n = math.floor(min(limits) + 1e-9)
    n_gsm8k = round(gsm8k_fraction * n)
    n_general = n - n_gsm8k
    if n_general > num_general or n_gsm8k > num_gsm8k:
        raise ValueError(f"a mixture of {n} at gsm8k_fraction {gsm8k_fraction} needs {n_general} general and "
                         f"{n_gsm8k} GSM8K prompts; there are {num_general} and {num_gsm8k}")
    return n_general, n_gsm8k


def mix_prompts(general: Sequence[PromptRecord], gsm8k: Sequence[PromptRecord], gsm8k_fraction: float,
                n: Optional[int], seed: int) -> List[PromptRecord]:
    """round(gsm8k_fraction * n) GSM8K prompts and the rest general, each drawn without replacement,
    shuffled together (seeded). ``n`` None: as many as the pools allow at that fraction."""
    n_general, n_gsm8k = mix_counts(len(general), len(gsm8k), gsm8k_fraction, n)
    rng = random.Random(seed)
    mixed = rng.sample(list(general), n_general) + rng.sample(list(gsm8k), n_gsm8k)
    rng.shuffle(mixed)
    return mixed


def load_heldout(path: str = DEFAULT_HELDOUT_PATH) -> List[Dict]:
    """The held-out prompts ({"id", "kind", "prompt", "source"} per line)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def heldout_overlap(prompts: Sequence[str], heldout: Sequence[str]) -> List[int]:
    """Indices of ``prompts`` equal to a held-out prompt after ``normalize_prompt`` (must be empty to train)."""
    keys = {normalize_prompt(h) for h in heldout}
    return [i for i, p in enumerate(prompts) if normalize_prompt(p) in keys]

