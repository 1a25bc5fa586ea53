"""lightllm/tools/report.py: the shared measures and the table / JSON writer, by hand."""
import json
import math
from dataclasses import dataclass

import pytest

from lightllm.tools.report import (
    Column,
    first_difference,
    first_token_difference,
    ratio,
    render_table,
    same_fraction,
    tokens_per_step,
    write_json,
)


def test_measures():
    assert tokens_per_step(48, 24) == 2.0  # 48 tokens from 24 steps
    assert tokens_per_step(5, 0) == 1.0 and tokens_per_step(0, 0) is None
    assert ratio(3.0, 2.0) == 1.5 and ratio(None, 2.0) is None and ratio(3.0, 0.0) is None and ratio(3.0, None) is None
    assert same_fraction(["a", "b", "c", "d"], ["a", "x", "c", "d"]) == 0.75
    with pytest.raises(ValueError):
        same_fraction(["a"], ["a", "b"])
    with pytest.raises(ValueError):
        same_fraction([], [])


def test_first_difference():
    assert first_token_difference([1, 2, 3], [1, 7, 3]) == 1
    assert first_token_difference([1, 2], [1, 2, 3]) == 2  # a prefix: the shorter length
    assert first_difference([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert first_difference([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]]) == (1, 1)
    assert first_difference([[1, 2]], [[1, 2, 3]]) == (0, 2)


COLUMNS = [Column("name", "config"), Column("tps", "tok/s", ".1f"), Column("x", "x HF", ".2f", "x")]


def test_plain_table_aligns_and_marks_missing():
    table = render_table([{"name": "plain", "tps": 1234.56, "x": 2.5}, {"name": "transformers", "tps": 9.0}], COLUMNS)
    assert table.splitlines() == [
        "config         tok/s   x HF",
        "------------  ------  -----",
        "plain         1234.6  2.50x",
        "transformers     9.0      -",
    ]


@dataclass
class Row:
    name: str
    share: float
    gain: float
    per_round: list
    flag: bool


def test_markdown_table_of_objects():
    cols = [Column("name", "arm"), Column("share", "accuracy", ".2%"), Column("gain", "vs B = 0", "+.1%"),
            Column("per_round", "per round", lambda xs: ", ".join(f"{x:.1f}" for x in xs)), Column("flag", "ok"),
            Column("absent", "absent")]
    table = render_table([Row("a", 0.75, 0.233, [1.0, 1.25], True), Row("b", math.nan, -0.05, [], False)], cols,
                         markdown=True)
    assert table.splitlines() == [
        "| arm | accuracy | vs B = 0 | per round | ok | absent |",
        "|---|---|---|---|---|---|",
        "| a | 75.00% | +23.3% | 1.0, 1.2 | True | - |",
        "| b | - | -5.0% |  | False | - |",
    ]


def test_write_json_makes_the_folder(tmp_path):
    path = tmp_path / "a" / "b.json"
    write_json(str(path), {"x": [1, 2]})
    assert json.loads(path.read_text()) == {"x": [1, 2]}
    write_json(str(path), [1], indent=None)
    assert path.read_text() == "[1]"
