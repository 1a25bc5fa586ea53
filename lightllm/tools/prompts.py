"""The prompt sets of the tools and benchmarks (GSM8K, prompt files) and the one chat-template
rule (docs/tools.md): the chat template over one user turn with the generation prompt, tokenized
with ``add_special_tokens=False``, as the engine's ``/v1/chat/completions`` does.
"""
import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from itertools import islice
from typing import Callable, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GSM8K_DIR_ENV = "LIGHTLLM_GSM8K_DIR"
GSM8K_BESIDE_CHECKOUT = os.path.join(REPO, "..", "shared", "data", "gsm8k")
# The user turn of the evaluation: the answer is read as the last number of the output
SOLVE_PROMPT = "{question}\nSolve it step by step, then give the final answer as a number."
ANSWER_MARK = "####"
ANSWER_RTOL = 1e-9
# A number: with thousands separators ("1,234.50") or plain ("12", "3.5"). A minus sign
# counts only where it cannot be a binary minus: "is -7" -> -7, but "5-3" -> 5 and 3.
_NUMBER_RE = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def gsm8k_path(split: str, given: Optional[str] = None) -> str:
    """``given`` when set, else ``{split}.jsonl`` in ``$LIGHTLLM_GSM8K_DIR`` or beside the checkout."""
    if given:
        return given
    return os.path.join(os.environ.get(GSM8K_DIR_ENV) or GSM8K_BESIDE_CHECKOUT, f"{split}.jsonl")


def gsm8k_parser(split: str, num_questions: Optional[int] = None) -> argparse.ArgumentParser:
    """``--data`` (default: ``gsm8k_path(split)``) and ``--num_questions``: a parent of the tools' parsers."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--data", default=gsm8k_path(split),
                   help=f"GSM8K {split} jsonl ({{question, answer}}; default: {split}.jsonl in ${GSM8K_DIR_ENV} "
                        "or ../shared/data/gsm8k beside the checkout)")
    p.add_argument("--num_questions", type=int, default=num_questions,
                   help=f"the first N questions (default: {num_questions or 'all'})")
    return p


@dataclass(frozen=True)
class Question:
    index: int  # line number in the file (0-based)
    question: str
    gold: Optional[float]  # the number after ####; None when the record has no answer


class DataFileNotFound(FileNotFoundError):
    """A prompt set's file is missing: the tools' command lines print its message, not a traceback."""


def run_tool(main: Callable[[], object]) -> None:
    """A tool's ``__main__``: exit with ``main()``'s status (0 unless it returns an int); a missing prompt file
    exits with its message, not a traceback."""
    try:
        status = main()
    except DataFileNotFound as e:
        sys.exit(f"error: {e}")
    sys.exit(status if isinstance(status, int) else 0)


def load_gsm8k(path: str, num_questions: Optional[int] = None) -> List[Question]:
    """The first ``num_questions`` records of a GSM8K jsonl file (all when None)."""
    if not os.path.isfile(path):
        raise DataFileNotFound(f"GSM8K file {path} not found: pass its path (--data), or set ${GSM8K_DIR_ENV} to a "
                               "folder holding train.jsonl and test.jsonl")
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if num_questions is not None and len(out) >= num_questions:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            gold = gold_answer(rec["answer"]) if "answer" in rec else None
            if "answer" in rec and gold is None:
                raise ValueError(f"{path}:{i + 1}: no number after {ANSWER_MARK!r} in the answer")
            out.append(Question(i, rec["question"], gold))
    if not out:
        raise ValueError(f"{path}: no questions")
    return out


def solve_turns(questions: Sequence[Question]) -> List[str]:
    """The evaluation's user turn of each question (SOLVE_PROMPT)."""
    return [SOLVE_PROMPT.format(question=q.question) for q in questions]


def parse_number(s: str) -> Optional[float]:
    try:
        return float(s.replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


def extract_answer(text: str) -> Optional[float]:
    """The last number in ``text`` (commas stripped), or None when there is none.

    "$1,234.50" -> 1234.5, "is -7." -> -7.0, "5-3=2" -> 2.0.
    """
    found = _NUMBER_RE.findall(text)
    return parse_number(found[-1]) if found else None


def gold_answer(answer: str) -> Optional[float]:
    """The number after ``####`` of a GSM8K answer."""
    if ANSWER_MARK not in answer:
        return None
    return parse_number(answer.rsplit(ANSWER_MARK, 1)[1])


def is_correct(pred: Optional[float], gold: Optional[float]) -> bool:
    return pred is not None and gold is not None and math.isclose(pred, gold, rel_tol=ANSWER_RTOL,
                                                                  abs_tol=ANSWER_RTOL)


def load_prompt_file(path: str, n: int) -> List[str]:
    """One prompt per non-empty line; a line that is a JSON string is decoded (so prompts can hold newlines)."""
    with open(path) as f:
        lines = islice((line.rstrip("\n") for line in f if line.strip()), n)
        return [json.loads(line) if line.startswith('"') else line for line in lines]


def take_cyclic(items: Sequence, n: int) -> List:
    """n items, repeating ``items`` if there are fewer."""
    if not items:
        raise ValueError("no prompts")
    return [items[i % len(items)] for i in range(n)]


def _template(tokenizer, user_text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                         tokenize=False)


def chat_prompt_ids(tokenizer, user_texts: Sequence[str]) -> List[List[int]]:
    """The chat endpoint's prompt ids of one user turn each."""
    return [tokenizer.encode(_template(tokenizer, t), add_special_tokens=False) for t in user_texts]


def chat_prompt_texts(tokenizer, user_texts: Sequence[str]) -> List[str]:
    """The text of each prompt for ``/generate``, which the server tokenizes to ``chat_prompt_ids``: it adds
    special tokens, so a BOS the template writes is left out when the tokenizer would add it again."""
    bos = tokenizer.bos_token
    adds_bos = bool(bos) and tokenizer.encode("", add_special_tokens=True)[:1] == [tokenizer.bos_token_id]
    texts = [_template(tokenizer, t) for t in user_texts]
    return [t[len(bos):] if adds_bos and t.startswith(bos) else t for t in texts]


# Times the cut of a text's tokens is moved to hit a token count after re-tokenization.
LENGTH_FIT_TRIES = 8


def fit_text_to_tokens(tokenizer, n_tokens: int, texts: Sequence[str], start: int, first_cut: int,
                       render: Callable[[str], str], count: Callable[[str], int]) -> Tuple[str, int]:
    """(``render(text)``, its ``count``) of ``n_tokens``, ``text`` made of ``texts`` from ``start``
    (cycling, one blank line apart) with its tokens cut. The rendered text is re-tokenized where it
    is used, so the cut (``first_cut`` tokens at first) is moved until the count is ``n_tokens``, or
    the closest not above it (a cut can swing by one token)."""
    pieces, chars, i = [], 0, start
    while chars < 8 * n_tokens:  # a token is rarely more than 8 characters of this text
        pieces.append(texts[i % len(texts)])
        chars += len(pieces[-1]) + 2
        i += 1
    body = tokenizer.encode("\n\n".join(pieces), add_special_tokens=False)
    cut, tried = first_cut, {}
    for _ in range(LENGTH_FIT_TRIES):
        text = render(tokenizer.decode(body[:cut]))
        got = tried[cut] = (count(text), text)
        if got[0] == n_tokens or cut + n_tokens - got[0] in tried:
            break
        cut += n_tokens - got[0]
    # the exact count, else the closest not above it, else the closest
    best = min(tried.values(), key=lambda t: (t[0] != n_tokens, t[0] > n_tokens, abs(t[0] - n_tokens)))
    return best[1], best[0]
