"""Type checks for numbers that arrive from JSON or Python callers."""
from typing import Any


def is_number(v: Any) -> bool:
    """An int or a float; True and False are not numbers here."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)
