"""Incremental detokenization: the text of a request's growing output ids, decoding only a short
window at the end on each update (vLLM's / TGI's prefix_offset / read_offset scheme) instead of
all the ids, yet equal to ``tokenizer.decode(ids, skip_special_tokens=True)`` after every update.

Vocabulary
- *read offset* r: tokens [0, r) are committed; their text (the *committed text*) is final.
- *prefix offset* p: the window decoded on each update is ids[p:] (p is the previous read offset).
  Its first part, the text of ids[p:r] (the *prefix text*), is decoded separately and cut off, so
  what a decoder does at the start of a sequence (SentencePiece drops the first leading space)
  cancels out.
- *pending text*: the rest of the window; it may still change (an open UTF-8 sequence shown as
  U+FFFD, a run of byte-fallback tokens not yet ended).
- *clean boundary*: a read offset r where ``decode(ids[:n]) == committed + decode(ids[p:n])[len(prefix
  text):]`` holds for every continuation: the text so far does not end in U+FFFD (no UTF-8
  sequence is open) and token r-1 is an ordinary vocabulary token: not an added or special token
  (it may be skipped, leaving the window without its first token) and not a byte-fallback token
  ``<0xAB>`` (a run of them is decoded as one: a later invalid byte turns the whole run into
  U+FFFD). Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) and SentencePiece-style decoders
  (Metaspace, or Replace + ByteFallback + Fuse + Strip) keep that promise; the read offset only
  moves to clean boundaries.

A tokenizer whose decode cleans up spaces over the whole text (``clean_up_tokenization_spaces``
on a WordPiece / Unigram model) is not local: its requests never commit, so each update decodes
all the ids, as before. If a window ever disagrees with its prefix text the request falls back
to that too.
"""
import bisect
import logging
import re
from dataclasses import dataclass, field
from typing import Any, FrozenSet, List, Optional, Sequence

logger = logging.getLogger(__name__)

# What decode() shows for an incomplete (or invalid) UTF-8 sequence
REPLACEMENT_CHAR = "\ufffd"
# SentencePiece byte-fallback tokens: one byte each, decoded together as a run
BYTE_FALLBACK_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
BYTE_FALLBACK_PREFIX = "<0x"
# Text whose decode changes when spaces before punctuation are cleaned up
CLEANUP_PROBE = "a . b , c ? d ! e n't f 's g 're"
# More text for the backend check (multi-byte characters, spaces and newlines)
BACKEND_PROBE = " Hello  world\n\n\t x = 1 + 2; caf\u00e9 \u4f60\u597d \U0001f600 end."


def _decodes_locally(tokenizer) -> bool:
    """False when decode() cleans up spaces over the whole text (not window by window)."""
    ids = tokenizer.encode(CLEANUP_PROBE, add_special_tokens=False)
    cleaned = tokenizer.decode(ids, skip_special_tokens=True)
    return cleaned == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _backend_decoder(tokenizer) -> Optional[Any]:
    """The ``tokenizers`` object behind a fast transformers tokenizer when its decode is the same
    as the tokenizer's (which then only adds Python overhead: about 5x the Rust decode of a short
    window, twice per update), else None. transformers' fast decode is the backend's decode
    followed, when enabled, by a clean-up of spaces before punctuation, which would change
    CLEANUP_PROBE: so equal decodes of the probes mean no clean-up, hence equal decodes of any ids."""
    from transformers import PreTrainedTokenizerBase

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(tokenizer, PreTrainedTokenizerBase) or backend is None:
        return None
    try:
        ids = tokenizer.encode(CLEANUP_PROBE + BACKEND_PROBE, add_special_tokens=False)
        ids = ids + sorted(tokenizer.all_special_ids) + ids[:3]
        same = all(tokenizer.decode(x, skip_special_tokens=True) == backend.decode(x, skip_special_tokens=True)
                   for x in (ids, ids[1:], ids[:1], []))
    except Exception:  # a backend that does not decode plain id lists
        return None
    return backend if same else None


@dataclass(frozen=True)
class DetokenizerVocab:
    """What incremental detokenization needs to know about a tokenizer: built once per server."""

    tokenizer: Any
    # Tokens after which the read offset may not move: added / special and byte-fallback tokens
    unsafe_boundary_ids: FrozenSet[int]
    # False: decode() is not local (see the module docstring); requests never commit
    local: bool
    # What decode() calls: the tokenizer's ``tokenizers`` backend where it decodes the same, else None
    backend: Optional[Any] = None

    @classmethod
    def of(cls, tokenizer) -> "DetokenizerVocab":
        unsafe = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        unsafe.update(i for tok, i in tokenizer.get_vocab().items()
                      if tok.startswith(BYTE_FALLBACK_PREFIX) and BYTE_FALLBACK_TOKEN.fullmatch(tok))
        return cls(tokenizer=tokenizer, unsafe_boundary_ids=frozenset(unsafe), local=_decodes_locally(tokenizer),
                   backend=_backend_decoder(tokenizer))

    def decode(self, token_ids: Sequence[int]) -> str:
        """``tokenizer.decode(token_ids, skip_special_tokens=True)``."""
        if self.backend is not None:
            return self.backend.decode(token_ids, skip_special_tokens=True)
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


@dataclass(frozen=True)
class Commit:
    """The window state right after the read offset moved (one per move, kept for prefix lengths)."""

    read_offset: int  # r
    text_len: int  # len(decode(ids[:r]))
    prefix_offset: int  # p
    prefix_text_len: int  # len(decode(ids[p:r]))


START = Commit(read_offset=0, text_len=0, prefix_offset=0, prefix_text_len=0)


@dataclass
class IncrementalDetokenizer:
    """One request's detokenization state. ``update`` is called with the request's output ids
    after each worker update; between calls the ids only grow."""

    vocab: DetokenizerVocab
    committed: str = field(default="", init=False)  # text of ids[:read_offset]: final
    prefix_text: str = field(default="", init=False)  # text of ids[prefix_offset:read_offset], on its own
    # Characters at the start of the last returned text that the previous update returned too
    unchanged_len: int = field(default=0, init=False)
    local: bool = field(default=True, init=False)  # False once this request decodes all ids each update
    commits: List[Commit] = field(default_factory=lambda: [START], init=False)
    commit_offsets: List[int] = field(default_factory=lambda: [START.read_offset], init=False)  # for bisect

    def __post_init__(self) -> None:
        self.local = self.vocab.local

    @property
    def read_offset(self) -> int:
        return self.commits[-1].read_offset

    @property
    def prefix_offset(self) -> int:
        return self.commits[-1].prefix_offset

    def update(self, token_ids: Sequence[int]) -> str:
        """The text of all of ``token_ids`` (decode(token_ids, skip_special_tokens=True))."""
        if len(token_ids) < self.read_offset:
            raise ValueError(f"token ids shrank below the read offset: {len(token_ids)} < {self.read_offset}")
        self.unchanged_len = len(self.committed)  # committed text only ever grows
        window = self.vocab.decode(token_ids[self.prefix_offset:])
        if not window.startswith(self.prefix_text):
            logger.warning("incremental detokenization: window text does not extend its prefix; "
                           "this request decodes all its tokens on each update from now on")
            self._decode_everything()
            self.unchanged_len = 0
            window = self.vocab.decode(token_ids)
        pending = window[len(self.prefix_text):]
        if not self._clean_boundary(token_ids, pending):
            return self.committed + pending
        self.committed += pending
        n, r = len(token_ids), self.read_offset
        self.prefix_text = self.vocab.decode(token_ids[r:n])
        self._add_commit(Commit(read_offset=n, text_len=len(self.committed), prefix_offset=r,
                                prefix_text_len=len(self.prefix_text)))
        return self.committed

    def prefix_text_len(self, token_ids: Sequence[int], num_tokens: int) -> int:
        """len(decode(token_ids[:num_tokens])), decoding at most one window."""
        c = self.commits[bisect.bisect_right(self.commit_offsets, num_tokens) - 1]
        if num_tokens == c.read_offset:
            return c.text_len
        window = self.vocab.decode(token_ids[c.prefix_offset:num_tokens])
        return c.text_len + len(window) - c.prefix_text_len

    def _clean_boundary(self, token_ids: Sequence[int], pending: str) -> bool:
        """Whether the end of token_ids is a clean boundary (the committed text never ends in U+FFFD)."""
        return (self.local and len(token_ids) > self.read_offset
                and token_ids[-1] not in self.vocab.unsafe_boundary_ids
                and not pending.endswith(REPLACEMENT_CHAR))

    def _add_commit(self, c: Commit) -> None:
        self.commits.append(c)
        self.commit_offsets.append(c.read_offset)

    def _decode_everything(self) -> None:
        """Forget all commits: from now on the window is all the ids."""
        self.local = False
        self.committed, self.prefix_text = "", ""
        self.commits, self.commit_offsets = [START], [START.read_offset]
