"""JSON output in the worker (docs/structured_output.md): compiled grammars, each request's matcher,
and the token bitmasks of the rows a step samples.

A token bitmask is [rows, ceil(vocab / 32)] int32, bit t % 32 of word t // 32 set: token t is
allowed. Rows of requests without a grammar are all ones (``ALL_ALLOWED``); ``sample()`` applies
the mask (generic_post_process.apply_token_bitmask). Glossary of a request's rows in one step:
- row 0: the token after the committed ones (its matcher as it is);
- verify row j (MTP): the token after drafts 1..j, masked with the matcher after accepting them.
  The drafts are accepted on the host one by one, the rows filled, then ``rollback`` undoes them.
  A draft the grammar refuses (or one that ends it) leaves the rows after it all ones: the row
  before it forbids that draft, so verification never commits past it.
"""
import logging
from typing import List, Optional, Sequence

import torch

from lightllm.server.core.objs.response_format import XGRAMMAR_MISSING, ResponseFormat

logger = logging.getLogger(__name__)

BITS_PER_WORD = 32
ALL_ALLOWED = -1  # a bitmask word with every bit set


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


class RequestGrammar:
    """One request's matcher: the committed tokens go in (``accept``); masks are read from it."""

    def __init__(self, matcher):
        self.matcher = matcher  # xgrammar.GrammarMatcher

    def accept(self, token_id: int) -> bool:
        """Commit one token; False when the grammar refuses it (never for a masked choice)."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar accepted its stop token: the output is complete."""
        return bool(self.matcher.is_terminated())

    def fill_rows(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]) -> None:
        """Row ``first_row`` from the matcher as it is, row ``first_row + j`` after drafts[:j]
        (bitmask [rows, W] int32 host, rows past the block untouched); the matcher is restored."""
        accepted = 0
        if not self.terminated:
            self.matcher.fill_next_token_bitmask(bitmask, first_row)
            for j, tok in enumerate(drafts):
                if not self.matcher.accept_token(int(tok)):
                    break
                accepted += 1
                if self.terminated:
                    break
                self.matcher.fill_next_token_bitmask(bitmask, first_row + j + 1)
        if accepted:
            self.matcher.rollback(accepted)


class GrammarCompiler:
    """Compiles response formats for one worker, cached by the schema's canonical JSON. The
    tokenizer's xgrammar view (``TokenizerInfo``) is built on the first grammar request: a worker
    that never sees one pays nothing."""

    def __init__(self, model_dir: str, vocab_size: int):
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._compiler = None

    def _xgr_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise RuntimeError(XGRAMMAR_MISSING) from None
            from transformers import AutoTokenizer

            info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(self.model_dir),
                                                      vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        return self._compiler

    def matcher(self, fmt: ResponseFormat, stop_token_ids: List[int]) -> RequestGrammar:
        """A fresh matcher of ``fmt``; it ends on one of ``stop_token_ids`` (the request's eos ids;
        empty: the tokenizer's)."""
        import xgrammar as xgr

        compiled = self._xgr_compiler().compile_json_schema(fmt.schema, any_whitespace=False,
                                                            strict_mode=fmt.strict_mode)
        return RequestGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None))


def rows_bitmask(grammars: Sequence[Optional[RequestGrammar]], drafts: Sequence[Sequence[int]],
                 vocab_size: int) -> Optional[torch.Tensor]:
    """[sum(1 + len(drafts[i])), W] int32 host: entry i's block of rows masked by its grammar (row j
    after its drafts[:j]; all ones without a grammar). None when no entry has a grammar."""
    if all(g is None for g in grammars):
        return None
    sizes = [1 + len(d) for d in drafts]
    bitmask = torch.full((sum(sizes), bitmask_width(vocab_size)), ALL_ALLOWED, dtype=torch.int32)
    row = 0
    for g, d, size in zip(grammars, drafts, sizes):
        if g is not None:
            g.fill_rows(bitmask, row, d)
        row += size
    return bitmask
