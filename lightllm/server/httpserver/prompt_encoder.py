"""Prompt tokenization that reuses the pieces of prompts seen before.

Clients resend long prompts (every turn of a chat, an agent's instructions, a RAG document): the
prompt cache keeps their KV, but tokenizing 6000 tokens again still takes longer than prefilling
the 50 new ones. ``PromptEncoder`` cuts a prompt into chunks at points where the tokenizer's own
pre-tokenizer always splits, so ``encode(text) == concat(encode(chunk) for chunk)``, and keeps the
ids of recent chunks (LRU); a resent prompt encodes only its chunks that changed.

The cut is exact only for tokenizers whose pre-tokenizer is byte-level BPE with the GPT-2 split
pattern (GPT-2, SmolLM2, StarCoder, ...), optionally after splitting digits: that pattern never
joins a non-space character and a following space or newline in one piece. Every other tokenizer
(a normalizer, a Metaspace or a custom split pattern, added tokens that hold whitespace or strip
it) is encoded whole, as before. ``PromptEncoder.of`` also checks its result against the
tokenizer's own on a probe text, and falls back to whole encoding on any difference.
"""
import array
import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

# Characters per chunk before the next cut point (a cut is the first one at or after this)
CHUNK_CHARS = 1024
# Characters of chunk text whose ids are kept (least recently used dropped first); the ids take
# about one byte per character (4-byte ids, about 4 characters per token)
CACHE_CHARS = 1 << 24
# A cut point: after a printable ASCII character other than the space, before a space or newline.
# No piece of the GPT-2 pattern holds a non-space followed by whitespace, so every such point ends
# a piece (ASCII on both sides: Python's and the tokenizer's regex agree on what is whitespace).
CUT = re.compile(r"[\x21-\x7e](?=[ \n])")
# Checked at start-up against the tokenizer's own encoding, cut every few characters: words,
# digits, runs of spaces and newlines, punctuation, contractions, tabs and CR, non-ASCII text
PROBE_TEXT = ("Hello world!  It's 2026-12-01, 3.14159 and 12345678.\n\n\n  Indented line;\tx = y + 1\r\n"
              "  don't we'll they've I'm he'd  \u00e9t\u00e9 na\u00efve \u4f60\u597d \U0001f600 emoji \n"
              "trailing spaces   \nend.")
PROBE_CHUNK_CHARS = 3  # the probe's chunk length: a cut at nearly every cut point


def split_prompt(text: str, chunk_chars: int = CHUNK_CHARS) -> List[str]:
    """``text`` as chunks (joined, they are ``text``), each cut at the first cut point at or after
    ``chunk_chars`` from the last cut. The cuts depend only on the text before them (and the
    character after), so two prompts that start alike share their leading chunks."""
    out, last = [], 0
    while last + chunk_chars < len(text):
        m = CUT.search(text, last + chunk_chars - 1)  # the character before a cut at last + chunk_chars
        if m is None:
            break
        out.append(text[last:m.end()])
        last = m.end()
    out.append(text[last:])
    return out


def _is_gpt2_byte_level(pre) -> bool:
    return (pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False))


def _pre_tokenizer_cuts_at_spaces(pre: Optional[dict]) -> bool:
    """A byte-level GPT-2 split, alone or after individual digits."""
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers", [])
        return (len(steps) >= 1 and _is_gpt2_byte_level(steps[-1])
                and all(s.get("type") == "Digits" for s in steps[:-1]))
    return _is_gpt2_byte_level(pre)


def cuts_are_exact(tokenizer_json: dict) -> Tuple[bool, str]:
    """Whether cutting at cut points keeps the encoding of this tokenizer (``tokenizer.json``'s
    content), and why not."""
    if tokenizer_json.get("normalizer") is not None:
        return False, "the tokenizer normalizes text"
    if not _pre_tokenizer_cuts_at_spaces(tokenizer_json.get("pre_tokenizer")):
        return False, "its pre-tokenizer is not byte-level with the GPT-2 split"
    for tok in tokenizer_json.get("added_tokens", []):
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
            return False, f"the added token {tok.get('content')!r} strips or matches whole words"
        if any(ch.isspace() for ch in tok.get("content", "")):
            return False, f"the added token {tok.get('content')!r} holds whitespace"
    return True, ""


def _special_affixes(tokenizer) -> Optional[Tuple[List[int], List[int]]]:
    """(prefix, suffix) ids that ``add_special_tokens=True`` puts around a text's ids, the same
    for two probes; None when it does something else."""
    found = []
    for probe in ("hello world", "2 + 2 = 4\n"):
        plain = tokenizer.encode(probe, add_special_tokens=False)
        full = tokenizer.encode(probe, add_special_tokens=True)
        starts = [i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain]
        if not starts:
            return None
        i = starts[0]
        found.append((full[:i], full[i + len(plain):]))
    return found[0] if found[0] == found[1] else None


@dataclass
class ChunkCache:
    """Chunk text -> its ids, least recently used dropped past ``max_chars``; thread-safe."""

    max_chars: int = CACHE_CHARS
    chars: int = 0
    _ids: "OrderedDict[str, array.array]" = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, chunk: str) -> Optional[array.array]:
        with self._lock:
            ids = self._ids.get(chunk)
            if ids is not None:
                self._ids.move_to_end(chunk)
            return ids

    def put(self, chunk: str, ids: array.array) -> None:
        if len(chunk) > self.max_chars:
            return
        with self._lock:
            if chunk in self._ids:
                return
            self._ids[chunk] = ids
            self.chars += len(chunk)
            while self.chars > self.max_chars:
                old, _ = self._ids.popitem(last=False)
                self.chars -= len(old)


class PromptEncoder:
    """``encode(text, add_special_tokens)`` equal to ``tokenizer.encode``; chunked and cached
    where the tokenizer allows it (``chunked``), whole otherwise."""

    def __init__(self, tokenizer, chunked: bool, affixes: Tuple[Sequence[int], Sequence[int]] = ((), ()),
                 chunk_chars: int = CHUNK_CHARS, cache_chars: int = CACHE_CHARS):
        self.tokenizer = tokenizer
        self.chunked = chunked
        self.prefix, self.suffix = list(affixes[0]), list(affixes[1])
        self.chunk_chars = chunk_chars
        self.cache = ChunkCache(cache_chars)
        self.hits = 0  # chunks found in the cache
        self.misses = 0  # chunks encoded

    @classmethod
    def of(cls, tokenizer, chunk_chars: int = CHUNK_CHARS, cache_chars: int = CACHE_CHARS) -> "PromptEncoder":
        """Chunked when ``tokenizer`` (a transformers fast tokenizer) allows exact cuts and its
        chunked encoding of PROBE_TEXT is its own; whole otherwise (logged)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            logger.info("prompts are tokenized whole: not a fast (tokenizers) tokenizer")
            return cls(tokenizer, False)
        ok, why = cuts_are_exact(json.loads(backend.to_str()))
        affixes = _special_affixes(tokenizer) if ok else None
        if ok and affixes is None:
            ok, why = False, "its special tokens are not a fixed prefix and suffix"
        if not ok:
            logger.info("prompts are tokenized whole: %s", why)
            return cls(tokenizer, False)
        probe = cls(tokenizer, True, affixes, PROBE_CHUNK_CHARS, cache_chars)
        for special in (False, True):
            if probe.encode(PROBE_TEXT, special) != tokenizer.encode(PROBE_TEXT, add_special_tokens=special):
                logger.warning("prompts are tokenized whole: cut into chunks, the probe text tokenizes differently")
                return cls(tokenizer, False)
        return cls(tokenizer, True, affixes, chunk_chars, cache_chars)

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        if not self.chunked:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        chunks = split_prompt(text, self.chunk_chars)
        found = [self.cache.get(c) for c in chunks]
        missing = [i for i, ids in enumerate(found) if ids is None]
        if missing:
            encodings = self.tokenizer.backend_tokenizer.encode_batch(
                [chunks[i] for i in missing], add_special_tokens=False)
            for i, e in zip(missing, encodings):
                found[i] = array.array("i", e.ids)
                self.cache.put(chunks[i], found[i])
        self.hits += len(chunks) - len(missing)
        self.misses += len(missing)
        ids = self.prefix.copy() if add_special_tokens else []
        for part in found:
            ids.extend(part)
        if add_special_tokens:
            ids.extend(self.suffix)
        return ids
