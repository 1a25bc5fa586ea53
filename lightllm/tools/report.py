"""What the tools and benchmarks report, written one way: the shared measures (tokens per
step, ratios, output comparisons), tables (plain text or Markdown) and JSON files."""
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple, Union

MISSING = "-"  # a table cell without a value


def tokens_per_step(output_tokens: int, accepted_drafts: int) -> Optional[float]:
    """Committed tokens per decode step: every step commits one token that is not an accepted
    draft (the prefill step's included), so steps = output tokens - accepted drafts."""
    steps = output_tokens - accepted_drafts
    return output_tokens / steps if steps > 0 else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, or None when either is unknown or b is 0."""
    return a / b if a is not None and b else None


def first_token_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Position of the first differing token (the shorter length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def first_difference(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> Optional[Tuple[int, int]]:
    """(request position, token position) of the first difference of two outputs, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if list(x) != list(y):
            return i, first_token_difference(x, y)
    return None


def same_fraction(values: Sequence, reference: Sequence) -> float:
    """The share of positions where ``values`` equals ``reference``."""
    if len(values) != len(reference):
        raise ValueError(f"{len(values)} values vs {len(reference)} reference values")
    if not values:
        raise ValueError("nothing to compare")
    return sum(a == b for a, b in zip(values, reference)) / len(values)


@dataclass(frozen=True)
class Column:
    key: str  # a dict key or an attribute of the row
    header: str
    fmt: Union[str, Callable[[Any], str]] = ""  # a format spec for numbers, or a function of the value
    suffix: str = ""  # after a formatted value (e.g. "x" for a ratio)


def cell(value, column: Column) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    if callable(column.fmt):
        return column.fmt(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, column.fmt) + column.suffix
    return str(value)


def _get(row, key: str):
    return row.get(key) if isinstance(row, dict) else getattr(row, key, None)


def render_table(rows: Sequence, columns: Sequence[Column], markdown: bool = False) -> str:
    """Rows (dicts or objects) as a table: Markdown, or plain text with the first column
    left-aligned and the rest right-aligned. A missing value is '-'."""
    cells = [[c.header for c in columns]] + [[cell(_get(r, c.key), c) for c in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join([lines[0], "|" + "---|" * len(columns)] + lines[1:])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]

    def line(row) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def write_json(path: str, obj, indent: Optional[int] = 2) -> None:
    """``obj`` as JSON at ``path`` (its folder made when missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
