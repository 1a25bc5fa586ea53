"""Incremental detokenization (issue 14, item 5: the HTTP process re-decoded all the output on
every update). Two references:
- the tokenizer's own ``decode(all ids so far, skip_special_tokens=True)``: the text after every
  update, and every prefix length the stream hold-back asks for;
- the previous implementation of ``HttpServerManager._update_text`` (full decodes, copied below):
  text, stop cut, token trimming, stream_text_len and stream_token_num after every update.

Tokenizers: the embedded model's (byte-level BPE), two SentencePiece-style ones built here with
byte fallback (a Llama-2 style and a Metaspace decoder), and a WordPiece one whose decode cleans up
spaces over the whole text (not local: it must fall back to full decodes). Inputs: text with
multi-byte characters (CJK, emoji: split over several tokens), special and added tokens, random
ids (invalid UTF-8, broken byte-fallback runs), fed in random-size updates.
"""
import dataclasses
import json
import queue
import random
from typing import Callable, List, Sequence

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightllm.server.core.objs.sampling_params import SamplingParams
from lightllm.server.core.objs.start_args_type import StartArgs
from lightllm.server.httpserver.detokenize import REPLACEMENT_CHAR, DetokenizerVocab, IncrementalDetokenizer
from lightllm.server.httpserver.manager import HttpServerManager, ReqResult, stop_prefix_len
from lightllm.server.router.manager import WorkerReady

MAX_UPDATE_TOKENS = 5  # the worker sends one MTP block (K + 1 tokens) per update at most
NUM_SEQUENCES = 40
NUM_STOP_CASES = 60
MAX_STOP_CHARS = 8
LOGPROB = -0.5
# Single-token updates of natural text: tokens decoded per update, on average, at most
MAX_DECODED_PER_UPDATE = 8
LONG_OUTPUT_TOKENS = 2000

WORDS = "the quick brown fox jumps over a lazy dog and then it runs away from home to school".split()
COMMON_CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可里后小"
CJK_RANGE = (0x4E00, 0x9FFF)
EMOJI_RANGE = (0x1F300, 0x1F64F)
OTHER_PIECES = [" ", "  ", "\n", ".", ",", " .", " ,", " ?", " !", " n't", " 's", "é", "ü", "ñ", "ß", "€", REPLACEMENT_CHAR]
SP_SPECIAL = ["<|im_start|>", "<|im_end|>"]
SP_ADDED = "<tool>"  # an added token that is not special: decode keeps it
SP_VOCAB_SIZE = 600
SP_ALPHABET = 60  # small: most CJK characters and every emoji fall back to bytes
SP_TRAIN_LINES = 2000
NUM_BYTES = 256


# ---------------------------------------------------------------- tokenizers

def _train_sp(legacy: bool) -> Tokenizer:
    """A SentencePiece-style BPE with byte fallback, trained here (no download)."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) if rng.random() < 0.7 else "".join(rng.choices(COMMON_CJK, k=3))
                      for _ in range(rng.randint(3, 12))) for _ in range(SP_TRAIN_LINES)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=SP_VOCAB_SIZE, limit_alphabet=SP_ALPHABET,
                                                       special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(NUM_BYTES):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    tok = Tokenizer.from_str(json.dumps(spec))
    if legacy:  # Llama 2's tokenizer.json
        tok.pre_tokenizer = None
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])
    tok.add_special_tokens([AddedToken(s, special=True) for s in SP_SPECIAL])
    tok.add_tokens([AddedToken(SP_ADDED, special=False)])
    return tok


def _wordpiece() -> Tokenizer:
    chars = sorted(set("".join(WORDS) + COMMON_CJK + ".,?!'"))
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2}
    for w in WORDS + chars + ["##" + c for c in chars] + ["n", "##t", "s"]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return tok


def _save(tok: Tokenizer, path, **kwargs) -> str:
    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """kind -> a model dir holding only a tokenizer (what HttpServerManager loads)."""
    root = tmp_path_factory.mktemp("detok")
    sp = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    dirs = {
        "sp_legacy": _save(_train_sp(legacy=True), root / "sp_legacy", **sp),
        "sp_metaspace": _save(_train_sp(legacy=False), root / "sp_metaspace", **sp),
        "wordpiece_cleanup": _save(_wordpiece(), root / "wordpiece", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", clean_up_tokenization_spaces=True),
    }
    try:
        from lightllm.utils.embedded_model import get_default_model_dir

        dirs["smollm2"] = get_default_model_dir()
    except Exception as e:  # the embedded model is not installed: its cases skip
        dirs["smollm2"] = e
    return dirs


KINDS = ["smollm2", "sp_legacy", "sp_metaspace", "wordpiece_cleanup"]
LOCAL_KINDS = ["smollm2", "sp_legacy", "sp_metaspace"]


def _model_dir(model_dirs, kind: str) -> str:
    d = model_dirs[kind]
    if isinstance(d, Exception):
        pytest.skip(f"embedded model unavailable: {d}")
    return d


@pytest.fixture(scope="module")
def load_tokenizer(model_dirs):
    """kind -> its tokenizer, loaded once (the test skips when the embedded model is missing)."""
    cache = {}

    def load(kind: str):
        if kind not in cache:
            cache[kind] = AutoTokenizer.from_pretrained(_model_dir(model_dirs, kind))
        return cache[kind]

    return load


# ---------------------------------------------------------------- inputs

def _random_text(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randint(5, 60)):
        r = rng.random()
        if r < 0.4:
            pieces.append(" " + rng.choice(WORDS))
        elif r < 0.55:
            pieces.append("".join(rng.choices(COMMON_CJK, k=rng.randint(1, 4))))
        elif r < 0.65:
            pieces.append("".join(chr(rng.randint(*CJK_RANGE)) for _ in range(rng.randint(1, 3))))
        elif r < 0.8:
            pieces.append("".join(chr(rng.randint(*EMOJI_RANGE)) for _ in range(rng.randint(1, 3))))
        else:
            pieces.append(rng.choice(OTHER_PIECES))
    return "".join(pieces)


def _random_ids(tok, rng: random.Random) -> List[int]:
    """Encoded text with special / added tokens and runs of random ids spliced in."""
    ids = tok.encode(_random_text(rng), add_special_tokens=False)
    extra = sorted(set(tok.all_special_ids) | set(tok.added_tokens_decoder))
    for _ in range(rng.randint(0, 4)):
        at = rng.randint(0, len(ids))
        if rng.random() < 0.5:
            ids[at:at] = [rng.choice(extra) for _ in range(rng.randint(1, 2))]
        else:
            ids[at:at] = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 6))]
    return ids


def _updates(ids: Sequence[int], rng: random.Random, max_tokens: int = MAX_UPDATE_TOKENS) -> List[List[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_tokens)
        out.append(list(ids[i:i + n]))
        i += n
    return out


# ---------------------------------------------------------------- the detokenizer alone

@pytest.mark.parametrize("kind", KINDS)
def test_text_equals_full_decode_after_every_update(load_tokenizer, kind):
    tok = load_tokenizer(kind)
    vocab = DetokenizerVocab.of(tok)
    assert vocab.local == (kind in LOCAL_KINDS)
    rng = random.Random(KINDS.index(kind))
    for _ in range(NUM_SEQUENCES):
        detok, ids, prev = IncrementalDetokenizer(vocab), [], ""
        for chunk in _updates(_random_ids(tok, rng), rng):
            ids.extend(chunk)
            text = detok.update(ids)
            assert text == tok.decode(ids, skip_special_tokens=True), ids
            assert text[:detok.unchanged_len] == prev[:detok.unchanged_len]
            prev = text
        assert detok.local == (kind in LOCAL_KINDS)  # never fell back to full decodes
        for m in range(len(ids) + 1):
            assert detok.prefix_text_len(ids, m) == len(tok.decode(ids[:m], skip_special_tokens=True)), (ids, m)


class CountingTokenizer:
    """Forwards to a tokenizer, counting the tokens it is asked to decode."""

    def __init__(self, tok):
        self.tok = tok
        self.decoded_tokens = 0

    def decode(self, token_ids, **kwargs):
        self.decoded_tokens += len(token_ids)
        return self.tok.decode(token_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("kind", LOCAL_KINDS)
def test_single_token_updates_decode_a_short_window(load_tokenizer, kind):
    """The regression: a long output fed one token at a time decodes O(1) tokens per update
    (the full-decode implementation decoded LONG_OUTPUT_TOKENS**2 / 2 in all)."""
    tok = load_tokenizer(kind)
    rng = random.Random(1)
    ids: List[int] = []
    while len(ids) < LONG_OUTPUT_TOKENS:  # natural text: words and CJK, emoji one at a time
        ids += tok.encode(" ".join(rng.choice(WORDS + list(COMMON_CJK) + ["😀 ok"]) for _ in range(50)),
                          add_special_tokens=False)
    ids = ids[:LONG_OUTPUT_TOKENS]
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(DetokenizerVocab.of(counting))
    counting.decoded_tokens = 0
    for n in range(1, len(ids) + 1):
        text = detok.update(ids[:n])
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert counting.decoded_tokens <= MAX_DECODED_PER_UPDATE * len(ids)


class ShiftingTokenizer:
    """A decode that is not local in a way the window notices (a text starts with its number of
    tokens): the request must fall back to full decodes and stay exact."""

    all_special_ids: List[int] = []
    added_tokens_decoder: dict = {}

    def get_vocab(self):
        return {chr(ord("a") + i): i for i in range(26)}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 26 for c in text]

    def decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        if not token_ids:
            return ""
        return f"{len(token_ids)}:" + "".join(chr(ord("a") + i) for i in token_ids)


def test_window_that_does_not_extend_its_prefix_falls_back_to_full_decodes():
    tok = ShiftingTokenizer()
    detok = IncrementalDetokenizer(DetokenizerVocab.of(tok))
    rng = random.Random(2)
    ids = []
    for chunk in _updates([rng.randrange(26) for _ in range(40)], rng):
        ids.extend(chunk)
        assert detok.update(ids) == tok.decode(ids)
    assert not detok.local
    assert all(detok.prefix_text_len(ids, m) == len(tok.decode(ids[:m])) for m in range(len(ids) + 1))


@pytest.mark.parametrize("kind", KINDS)
def test_backend_decodes_only_where_it_equals_the_tokenizer(load_tokenizer, kind):
    """The fast path: transformers' decode wrapper cost about 5x the Rust decode of a short window
    (twice per update). The tokenizers backend is used only where it gives the tokenizer's text:
    not for the WordPiece tokenizer whose decode cleans up spaces."""
    tok = load_tokenizer(kind)
    vocab = DetokenizerVocab.of(tok)
    if kind == "smollm2":
        assert vocab.backend is not None
    if kind == "wordpiece_cleanup":
        assert vocab.backend is None
    rng = random.Random(7)
    for _ in range(NUM_SEQUENCES):
        ids = _random_ids(tok, rng)
        for start in range(0, len(ids) + 1, 3):
            assert vocab.decode(ids[start:]) == tok.decode(ids[start:], skip_special_tokens=True), ids[start:]
    assert DetokenizerVocab.of(CountingTokenizer(tok)).backend is None  # not a transformers tokenizer


# ---------------------------------------------------------------- the manager, against the old implementation

def old_update_text(decode: Callable[[List[int]], str], res: ReqResult, params: SamplingParams) -> None:
    """HttpServerManager._update_text before incremental detokenization, with its two binary
    searches over full decodes: the reference of the observable behaviour."""

    def tokens_covering(token_ids, kept):
        lo, hi = 0, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if decode(token_ids[:mid]).startswith(kept):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def tokens_within(token_ids, text_len, at_least):
        lo, hi = at_least, len(token_ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(decode(token_ids[:mid])) <= text_len:
                lo = mid
            else:
                hi = mid - 1
        return lo

    text = decode(res.token_ids)
    cut = min((i for i in (text.find(s) for s in params.stop_sequences) if i >= 0), default=-1)
    if cut >= 0:
        res.text = text[:cut]
        res.finish_reason = "stop"
        keep = tokens_covering(res.token_ids, res.text)
        del res.token_ids[keep:], res.logprobs[keep:]
    else:
        res.text = text
    if res.finish_reason is not None:
        res.stream_text_len, res.stream_token_num = len(res.text), len(res.token_ids)
        return
    visible = len(text) - stop_prefix_len(text, params.stop_sequences)
    if visible < len(text):
        res.stream_token_num = tokens_within(res.token_ids, visible, res.stream_token_num)
    else:
        res.stream_token_num = len(res.token_ids)
    res.stream_text_len = len(text[:visible].rstrip(REPLACEMENT_CHAR))


def _manager(model_dir: str) -> HttpServerManager:
    args = dataclasses.replace(StartArgs(), resolved_model_dir=model_dir)
    ready = WorkerReady(vocab_size=1, max_total_token_num=1, device="cpu", data_type="float32")
    return HttpServerManager(args, queue.Queue(), queue.Queue(), ready)


def _random_stops(text: str, rng: random.Random) -> List[str]:
    """Substrings of the final text (so matches straddle updates), sometimes one that never occurs."""
    stops = []
    for _ in range(rng.randint(0, 3)):
        if text and rng.random() < 0.8:
            at = rng.randrange(len(text))
            stops.append(text[at:at + rng.randint(1, MAX_STOP_CHARS)])
        else:
            stops.append("".join(rng.choices(WORDS, k=2)) + "#")
    return stops


@pytest.mark.parametrize("kind", KINDS)
def test_update_text_matches_full_decode_implementation(model_dirs, kind):
    manager = _manager(_model_dir(model_dirs, kind))
    tok = manager.tokenizer
    decode = manager._decode
    rng = random.Random(KINDS.index(kind) + len(KINDS))
    stops_found = held_back = 0
    try:
        for _ in range(NUM_STOP_CASES):
            ids = _random_ids(tok, rng)
            params = SamplingParams(stop_sequences=_random_stops(decode(ids), rng))
            new, old = ReqResult(prompt_tokens=1), ReqResult(prompt_tokens=1)
            detok = IncrementalDetokenizer(manager.detokenizer_vocab)
            updates = _updates(ids, rng)
            for i, chunk in enumerate(updates):
                for res in (new, old):
                    res.token_ids.extend(chunk)
                    res.logprobs.extend([LOGPROB] * len(chunk))
                    res.finish_reason = "length" if i == len(updates) - 1 else None  # as copy_totals_to
                manager._update_text(new, params, detok)
                old_update_text(decode, old, params)
                assert new == old, (ids, params.stop_sequences, i)
                held_back += new.stream_token_num < len(new.token_ids)
                if new.finish_reason is not None:
                    stops_found += new.finish_reason == "stop"
                    break
            assert detok.local == (kind in LOCAL_KINDS)
    finally:
        manager.shutdown()
    assert stops_found and held_back  # the cases did reach both paths


def _run_generate(manager: HttpServerManager, ids: List[int], params: SamplingParams, final_only: bool,
                  split: List[int], paced: bool = False) -> List[ReqResult]:
    """``generate`` over hand-dispatched worker updates (``split``: tokens per update, the last
    finishes); a copy of every result it yields. ``paced``: each update waits for the result before it
    (a caller that keeps up with the worker), else all are dispatched before the first is read."""
    import asyncio
    import copy

    from lightllm.server.core.objs.messages import ReqStepUpdate, StepTiming, WorkerStats

    async def main():
        manager._loop = asyncio.get_running_loop()
        seen = []
        gen = manager.generate([1, 2], params, final_only=final_only)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # generate() registered the request
        req_id, start = max(manager._streams), 0
        for j, n in enumerate(split):
            u = ReqStepUpdate(req_id, ids[start:start + n], [LOGPROB - start - i for i in range(n)],
                              "length" if j == len(split) - 1 else None, 2, 0, 0, 0.0)
            manager._dispatch([u], WorkerStats(0, 1, 0, StepTiming()))
            start += n
            if paced:
                try:
                    seen.append(copy.deepcopy(await (first if j == 0 else gen.__anext__())))
                except StopAsyncIteration:  # a stop string ended it
                    return seen
        if not paced:
            seen.append(copy.deepcopy(await first))
        async for res in gen:
            seen.append(copy.deepcopy(res))
        return seen

    return asyncio.run(main())


def test_final_only_takes_the_updates_together(model_dirs):
    """A caller that reads only the final result is woken once (without stop strings), and that
    result equals the last of the per-update results, with a stop string too (a stop string is looked for
    at every result, here over all the updates that waited). A stream behind the worker takes the
    updates waiting for it as one result (one chunk, not a burst)."""
    manager = _manager(_model_dir(model_dirs, "smollm2"))
    rng = random.Random(7)
    try:
        for _ in range(5):
            ids = _random_ids(manager.tokenizer, rng)
            cuts = sorted(rng.sample(range(1, len(ids)), min(4, len(ids) - 1)))
            split = [b - a for a, b in zip([0] + cuts, cuts + [len(ids)])]
            each = _run_generate(manager, ids, SamplingParams(), False, split, paced=True)
            once = _run_generate(manager, ids, SamplingParams(), True, split)
            behind = _run_generate(manager, ids, SamplingParams(), False, split)  # a stream behind the worker
            assert len(each) == len(split) and len(once) == 1 and len(behind) == 1
            assert [r.token_ids for r in each] == [ids[:sum(split[:j + 1])] for j in range(len(split))]
            assert once[-1] == each[-1] == behind[-1] and once[-1].token_ids == ids
            assert once[-1].logprobs == [LOGPROB - i for i in range(len(ids))]
            text = manager._decode(ids)
            stops = [text[len(text) // 2:len(text) // 2 + 3]] if len(text) > 6 else []
            with_stop = _run_generate(manager, ids, SamplingParams(stop_sequences=stops), True, split)
            reference = _run_generate(manager, ids, SamplingParams(stop_sequences=stops), False, split, paced=True)
            assert with_stop[-1] == reference[-1] and len(with_stop) == 1  # the waiting updates as one
        assert not manager._streams
    finally:
        manager.close()
