"""General training prompts without a dataset: ask the target model for user turns.

Magpie (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting
Aligned LLMs with Nothing", arXiv:2406.08464): an instruction-tuned model given only
its chat template's text up to where a user message begins writes a plausible user
message. Sampled at a moderate temperature, those messages are varied prompts of the
kinds the model was tuned on; the target then answers them (train_mtp_draft.py).

Vocabulary:
  user-turn prefix  the template's text up to the first character of a user message,
                    derived by rendering a sentinel user message and cutting at it
                    (``user_turn_prefix``); a system turn is kept as the template
                    renders it by default, or replaced by ``system_prompt``.
  end of turn       the template's text right after a user message (stripped to its
                    first special token, else its first line): the stop sequence.
  raw turn          one sampled user message: text, and whether it reached the end of
                    turn (``ended``) or hit max_new_tokens (overlong).
  prompt record     {"kind", "source", "prompt"}: one line of a prompt-set JSONL file.

Reproducibility (``MagpieConfig.seed_mode``):
  request  every request carries its own seed (``request_seed``); the engine derives each
           draw from the request's seed and output position, so a request's text does not
           depend on which other requests share its batch. The engine then seeds one
           generator per row per step (host work that grows with the batch).
  batch    the process's generators are seeded once per round (``torch.manual_seed``) and
           the requests draw from them: the same run repeats on the same device with the same
           batch size, and sampling costs nothing extra. In-process engine only (--tp 1).

CLI:
    python -m lightllm.tools.magpie_prompts --count 256 --out prompts.jsonl \\
        [--model_dir DIR] [--temperature T] [--top_p P] [--seed S] [--device cpu|cuda]
"""
import argparse
import dataclasses
import json
import logging
import math
import os
import random
import re
import time
import unicodedata
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

# A user message no template rewrites (letters and digits only: survives `| trim`, escaping)
SENTINEL = "MagpieSentinel7f3a9cUserTurn"
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 0.95
DEFAULT_MAX_NEW_TOKENS = 96  # a user turn longer than this is dropped as overlong
DEFAULT_OVERSAMPLE = 1.6  # requests per wanted prompt in the first round (filtering drops some)
MAX_ROUNDS = 8  # sampling rounds before giving up on reaching --count
# Request i of a run draws with seeds (offset(run seed) + i * SEED_STRIDE + position) mod 2**SEED_BITS:
# disjoint across the requests of a run (position < SEED_STRIDE, i < MAX_REQUESTS_PER_RUN). 32 bits,
# because CPU generators (mt19937) keep only a seed's low 32 bits: seeds 2**32 apart draw the same.
SEED_BITS = 32
SEED_STRIDE = 1 << 10
MAX_REQUESTS_PER_RUN = 1 << (SEED_BITS - 10)
SEED_MODES = ("request", "batch")  # see the module docstring
GEN_RUNNING_MAX_REQ_SIZE = 256  # requests decoded together
GEN_BATCH_MAX_TOKENS = 8192  # prompt tokens per prefill step

# Tags in the style of <|im_start|>, <|eot_id|>, <|user|>: never part of a real user message
GENERIC_TAG_PATTERN = re.compile(r"<\|[^<>|\s]{1,40}\|>")
ENDED_FINISH_REASONS = ("eos", "stop")  # the engine's FinishReason values that mean "reached the end of turn"

# prompt kinds and sources of a prompt set
KIND_GENERAL = "general"
KIND_MATH = "math"
SOURCE_MAGPIE = "magpie"
SOURCE_GSM8K = "gsm8k_train"
PROMPT_RECORD_KEYS = ("kind", "source", "prompt")

# the held-out set (benchmarks/data/README.md): never used for training
DEFAULT_HELDOUT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "benchmarks", "data", "heldout_prompts.jsonl")


# --------------------------------------------------------------------------- the template's user-turn prefix


@dataclass(frozen=True)
class UserTurnPrefix:
    text: str  # the template's text up to where a user message begins
    end_of_turn: str  # the template's marker right after a user message (the stop sequence)
    end_of_turn_ids: Tuple[int, ...]  # its token ids
    tags: Tuple[str, ...]  # strings no clean user message contains (special tokens, the turn markers)


def render_with_sentinel(tokenizer, system_prompt: Optional[str] = None) -> str:
    """The chat template rendered for one user turn whose content is SENTINEL (no generation prompt)."""
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages.append({"role": "user", "content": SENTINEL})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if text.count(SENTINEL) != 1:
        raise ValueError(f"the chat template rendered the user message {text.count(SENTINEL)} times, expected once")
    return text


def special_token_strings(tokenizer) -> List[str]:
    """The tokenizer's special and added tokens (e.g. <|im_start|>), longest first."""
    tokens = set(getattr(tokenizer, "all_special_tokens", []) or [])
    get_added = getattr(tokenizer, "get_added_vocab", None)
    if get_added is not None:
        tokens.update(get_added())
    return sorted((t for t in tokens if t and t.strip()), key=lambda t: (-len(t), t))


def end_of_turn_marker(suffix: str, specials: Sequence[str]) -> str:
    """The end-of-turn marker in the text after a user message: its leading special token, else its first line."""
    stripped = suffix.strip()
    for tok in specials:
        if stripped.startswith(tok):
            return tok
    line = stripped.split("\n", 1)[0].strip()
    if not line:
        raise ValueError(f"the chat template ends a user message with nothing to stop at: {suffix!r}")
    return line


def user_turn_prefix(tokenizer, system_prompt: Optional[str] = None) -> UserTurnPrefix:
    """Derive the user-turn prefix, end-of-turn marker and tags from ``tokenizer``'s chat template.

    ``system_prompt`` None: the system turn the template renders by default (SmolLM2's
    "You are a helpful AI assistant named SmolLM, ..."), none if it renders none."""
    rendered = render_with_sentinel(tokenizer, system_prompt)
    prefix, suffix = rendered.split(SENTINEL)
    specials = special_token_strings(tokenizer)
    eot = end_of_turn_marker(suffix, specials)
    eot_ids = tuple(tokenizer.encode(eot, add_special_tokens=False))
    # the user header: the prefix after the previous turn's end (the whole prefix without one)
    header = prefix.rsplit(eot, 1)[-1].strip()
    tags = tuple(dict.fromkeys([*specials, eot] + ([header] if header else [])))
    return UserTurnPrefix(text=prefix, end_of_turn=eot, end_of_turn_ids=eot_ids, tags=tags)


# --------------------------------------------------------------------------- cleaning (pure)


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
    ended: bool  # reached the end of turn (False: hit max_new_tokens)


# why a raw turn was dropped (FilterResult.dropped keys), in the order they are checked
DROP_OVERLONG = "overlong"
DROP_EMPTY = "empty"
DROP_TAG = "template_tag"
DROP_SHORT = "too_short"
DROP_LONG = "too_long"
DROP_DUPLICATE = "duplicate"
DROP_REASONS = (DROP_OVERLONG, DROP_EMPTY, DROP_TAG, DROP_SHORT, DROP_LONG, DROP_DUPLICATE)


@dataclass
class FilterResult:
    kept: List[str]  # cleaned prompts, in input order
    dropped: Dict[str, int] = field(default_factory=lambda: {r: 0 for r in DROP_REASONS})


def normalize_prompt(text: str) -> str:
    """The key for duplicate and held-out checks: NFKC, case-folded, punctuation dropped, spaces collapsed."""
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
    if len(text) > cfg.max_chars:
        return DROP_LONG
    return None


def filter_user_turns(turns: Sequence[RawTurn], tags: Sequence[str], cfg: FilterConfig = FilterConfig(),
                      seen: Sequence[str] = ()) -> FilterResult:
    """Strip and drop empty, short, overlong, tagged and duplicate turns (first occurrence kept).

    ``seen``: normalised texts already kept (earlier rounds); a turn matching one is a duplicate."""
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


# --------------------------------------------------------------------------- sampling with the engine


@dataclass(frozen=True)
class MagpieConfig:
    count: int = 256  # prompts wanted after filtering
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = -1  # -1: the whole vocabulary
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    seed: int = 0
    seed_mode: str = "request"  # a name in SEED_MODES
    system_prompt: Optional[str] = None  # None: the template's default system turn
    oversample: float = DEFAULT_OVERSAMPLE
    max_rounds: int = MAX_ROUNDS
    gen_batch_size: int = GEN_RUNNING_MAX_REQ_SIZE  # the engine's running_max_req_size
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

    def sampling_params(self, request_index: int) -> Dict:
        """The engine's request parameters of request ``request_index`` (0-based over the run)."""
        params = {"max_new_tokens": self.max_new_tokens, "do_sample": True, "temperature": self.temperature,
                  "top_p": self.top_p, "top_k": self.top_k}
        if self.seed_mode == "request":
            params["seed"] = request_seed(self.seed, request_index)
        return params


def request_seed(run_seed: int, request_index: int) -> int:
    """The engine seed of one request: its draws never share a seed with another request of the run;
    each run seed starts at its own pseudo-random offset."""
    if not 0 <= request_index < MAX_REQUESTS_PER_RUN:
        raise ValueError(f"request_index must be in [0, {MAX_REQUESTS_PER_RUN})")
    offset = random.Random(run_seed).getrandbits(SEED_BITS)
    return (offset + request_index * SEED_STRIDE) % (1 << SEED_BITS)


def strip_end_of_turn(token_ids: Sequence[int], end_of_turn_ids: Sequence[int],
                      eos_token_ids: Sequence[int]) -> List[int]:
    """Token ids without the trailing end-of-turn marker or eos token the engine stopped at."""
    ids = list(token_ids)
    n = len(end_of_turn_ids)
    if n and ids[-n:] == list(end_of_turn_ids):
        return ids[:-n]
    if ids and ids[-1] in eos_token_ids:
        return ids[:-1]
    return ids


def sample_user_turns(engine, tokenizer, prefix: UserTurnPrefix, cfg: MagpieConfig, first_index: int, n: int,
                      eos_token_ids: Sequence[int], progress: bool = False) -> List[RawTurn]:
    """Requests first_index .. first_index + n - 1 of the run: the prefix, sampled to the end of turn.

    ``engine``: an OfflineEngine whose max_req_total_len fits the prefix + max_new_tokens."""
    from lightllm.server.core.objs.sampling_params import SamplingParams

    prefix_ids = tokenizer.encode(prefix.text, add_special_tokens=False)  # the template carries its own BOS
    stop = [list(prefix.end_of_turn_ids)]
    if cfg.seed_mode == "batch":
        import torch

        torch.manual_seed(request_seed(cfg.seed, first_index))  # every device's generator, once per round
    params = [dataclasses.replace(SamplingParams.from_request(cfg.sampling_params(i)), stop_token_ids=stop)
              for i in range(first_index, first_index + n)]
    results = engine.generate([prefix_ids] * n, params, eos_token_ids=list(eos_token_ids), progress=progress)
    turns = []
    for r in results:
        if r.finish_reason == "error":
            raise RuntimeError(f"the engine failed a request: {r.error}")
        ids = strip_end_of_turn(r.token_ids, prefix.end_of_turn_ids, eos_token_ids)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        ended = r.finish_reason in ENDED_FINISH_REASONS
        if prefix.end_of_turn in text:  # a plain-text marker tokenised otherwise in context than alone
            text, ended = text.split(prefix.end_of_turn, 1)[0], True
        turns.append(RawTurn(text, ended))
    return turns


@dataclass
class MagpieResult:
    prompts: List[str]  # exactly cfg.count unless max_rounds ran out
    requests: int  # user turns sampled in all
    rounds: int
    dropped: Dict[str, int]  # by reason, over all rounds
    seconds: float
    prefix: UserTurnPrefix

    def records(self) -> List["PromptRecord"]:
        return [PromptRecord(KIND_GENERAL, SOURCE_MAGPIE, p) for p in self.prompts]


def collect_prompts(engine, tokenizer, prefix: UserTurnPrefix, cfg: MagpieConfig, eos_token_ids: Sequence[int],
                    progress: bool = False) -> MagpieResult:
    """Sample rounds of user turns until ``cfg.count`` survive the filter (or ``cfg.max_rounds`` ran out)."""
    start = time.monotonic()
    kept: List[str] = []
    dropped = {r: 0 for r in DROP_REASONS}
    requests = rounds = 0
    while len(kept) < cfg.count and rounds < cfg.max_rounds:
        missing = cfg.count - len(kept)
        # later rounds ask for the missing share at the yield seen so far (at least the oversample rate)
        rate = max(cfg.oversample, requests / len(kept)) if kept else cfg.oversample * (2 ** rounds)
        n = min(MAX_REQUESTS_PER_RUN - requests, math.ceil(missing * rate))
        if n == 0:
            break
        turns = sample_user_turns(engine, tokenizer, prefix, cfg, requests, n, eos_token_ids, progress)
        got = filter_user_turns(turns, prefix.tags, cfg.filter, seen=[normalize_prompt(p) for p in kept])
        kept.extend(got.kept)
        for r, c in got.dropped.items():
            dropped[r] += c
        requests += n
        rounds += 1
    if len(kept) < cfg.count:
        logger.warning("magpie: %d of %d prompts after %d rounds", len(kept), cfg.count, rounds)
    return MagpieResult(prompts=kept[: cfg.count], requests=requests, rounds=rounds, dropped=dropped,
                        seconds=time.monotonic() - start, prefix=prefix)


def generate_magpie_prompts(model_dir: str, cfg: MagpieConfig, device: Optional[str] = None,
                            dtype: Optional[str] = None, progress: bool = False, tokenizer=None) -> MagpieResult:
    """``cfg.count`` user prompts written by the model in ``model_dir`` (the project's OfflineEngine:
    batched, CUDA graphs on GPU). Same model, config and device: the same prompts."""
    import gc

    import torch
    from transformers import AutoTokenizer

    from lightllm.server.core.objs.start_args_type import StartArgs
    from lightllm.server.offline_engine import OfflineEngine

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    prefix = user_turn_prefix(tokenizer, cfg.system_prompt)
    max_len = len(tokenizer.encode(prefix.text, add_special_tokens=False)) + cfg.max_new_tokens
    args = StartArgs(model_dir=model_dir, running_max_req_size=cfg.gen_batch_size, max_req_total_len=max_len,
                     batch_max_tokens=max(GEN_BATCH_MAX_TOKENS, max_len))
    engine = OfflineEngine(args, device=device, dtype=dtype)
    try:
        result = collect_prompts(engine, tokenizer, prefix, cfg, engine.eos_token_ids(), progress)
    finally:
        engine.close()
    del engine  # free its KV pool before the caller loads another model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------- prompt sets


@dataclass(frozen=True)
class PromptRecord:
    kind: str  # KIND_GENERAL, KIND_MATH, or a held-out kind
    source: str  # SOURCE_MAGPIE, SOURCE_GSM8K, ...
    prompt: str


def as_records(prompts: Sequence[str], kind: str, source: str) -> List[PromptRecord]:
    return [PromptRecord(kind, source, p) for p in prompts]


def write_prompt_set(path: str, records: Sequence[PromptRecord]) -> None:
    """One {"kind", "source", "prompt"} JSON object per line (UTF-8)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(asdict(r), ensure_ascii=False) + "\n")


def read_prompt_set(path: str) -> List[PromptRecord]:
    """The records of a prompt-set file (extra keys are ignored; a missing key is an error)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            missing = [k for k in PROMPT_RECORD_KEYS if not isinstance(obj.get(k), str)]
            if missing:
                raise ValueError(f"{path}:{lineno}: missing or non-string {', '.join(missing)}")
            records.append(PromptRecord(obj["kind"], obj["source"], obj["prompt"]))
    return records


def mix_counts(num_general: int, num_gsm8k: int, gsm8k_fraction: float, n: Optional[int]) -> Tuple[int, int]:
    """(general, gsm8k) counts of a mixture of ``n`` prompts (None: the largest the pools allow)."""
    if not 0.0 <= gsm8k_fraction <= 1.0:
        raise ValueError(f"gsm8k_fraction must be in [0, 1], got {gsm8k_fraction}")
    if n is None:
        limits = []
        if gsm8k_fraction < 1.0:
            limits.append(num_general / (1.0 - gsm8k_fraction))
        if gsm8k_fraction > 0.0:
            limits.append(num_gsm8k / gsm8k_fraction)
        n = math.floor(min(limits) + 1e-9)
    n_gsm8k = round(gsm8k_fraction * n)
    n_general = n - n_gsm8k
    if n_general > num_general or n_gsm8k > num_gsm8k:
        raise ValueError(f"a mixture of {n} at gsm8k_fraction {gsm8k_fraction} needs {n_general} general and "
                         f"{n_gsm8k} GSM8K prompts; there are {num_general} and {num_gsm8k}")
    return n_general, n_gsm8k


def mix_prompts(general: Sequence[PromptRecord], gsm8k: Sequence[PromptRecord], gsm8k_fraction: float,
                n: Optional[int], seed: int) -> List[PromptRecord]:
    """A seeded mixture: round(gsm8k_fraction * n) GSM8K prompts, the rest general, each drawn without
    replacement, shuffled together. ``n`` None: as many as the pools allow at that fraction."""
    n_general, n_gsm8k = mix_counts(len(general), len(gsm8k), gsm8k_fraction, n)
    rng = random.Random(seed)
    mixed = rng.sample(list(general), n_general) + rng.sample(list(gsm8k), n_gsm8k)
    rng.shuffle(mixed)
    return mixed


# --------------------------------------------------------------------------- the held-out set


def load_heldout(path: str = DEFAULT_HELDOUT_PATH) -> List[Dict]:
    """The held-out prompts ({"id", "kind", "prompt", "source"} per line)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def heldout_overlap(prompts: Sequence[str], heldout: Sequence[str]) -> List[int]:
    """Indices of ``prompts`` equal to a held-out prompt after ``normalize_prompt`` (must be empty to train)."""
    keys = {normalize_prompt(h) for h in heldout}
    return [i for i, p in enumerate(prompts) if normalize_prompt(p) in keys]


# --------------------------------------------------------------------------- CLI


def make_parser() -> argparse.ArgumentParser:
    d = MagpieConfig()
    p = argparse.ArgumentParser(description="Sample user prompts from a chat model (Magpie) into a prompt-set JSONL.")
    p.add_argument("--count", type=int, default=d.count, help="prompts wanted after filtering")
    p.add_argument("--out", required=True, help="output JSONL ({'kind', 'source', 'prompt'} per line)")
    p.add_argument("--model_dir", default=None, help="HF model dir (default: the embedded SmolLM2)")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top_p", type=float, default=d.top_p)
    p.add_argument("--max_new_tokens", type=int, default=d.max_new_tokens, help="longer user turns are dropped")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--seed_mode", default=d.seed_mode, choices=SEED_MODES,
                   help="request: one seed per request (batch-independent); batch: seed the generators per round "
                        "(faster at large batches)")
    p.add_argument("--system_prompt", default=None, help="replaces the template's default system turn")
    p.add_argument("--gen_batch_size", type=int, default=d.gen_batch_size, help="requests decoded together")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    p.add_argument("--show", type=int, default=5, help="prompts printed in the summary")
    return p


def main(argv: Optional[Sequence[str]] = None) -> MagpieResult:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    a = make_parser().parse_args(argv)
    cfg = MagpieConfig(count=a.count, temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_new_tokens,
                       seed=a.seed, seed_mode=a.seed_mode,
                       system_prompt=a.system_prompt, gen_batch_size=a.gen_batch_size)
    model_dir = a.model_dir
    if model_dir is None:
        from lightllm.utils.embedded_model import get_default_model_dir

        model_dir = get_default_model_dir()
    result = generate_magpie_prompts(model_dir, cfg, device=a.device, progress=True)
    write_prompt_set(a.out, result.records())
    dropped = ", ".join(f"{k} {v}" for k, v in result.dropped.items() if v)
    print(f"{len(result.prompts)} prompts from {result.requests} sampled turns in {result.rounds} round(s), "
          f"{result.seconds:.1f} s (T={cfg.temperature}, top_p={cfg.top_p}, seed={cfg.seed}); "
          f"dropped: {dropped or 'none'}")
    for p in result.prompts[: a.show]:
        print("  -", p.replace("\n", " ")[:160])
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
