"""lightllm/tools/prompts.py: GSM8K records, answers and paths, prompt files, and the chat-template rule."""
import json
import os

import pytest

from lightllm.tools import prompts
from lightllm.tools.prompts import (
    Question,
    chat_prompt_ids,
    chat_prompt_texts,
    extract_answer,
    gold_answer,
    gsm8k_path,
    is_correct,
    load_gsm8k,
    load_prompt_file,
    solve_turns,
    take_cyclic,
)
from unit_tests.data_paths import require_gsm8k
from unit_tests.tools.fakes import FakeTokenizer


@pytest.mark.parametrize("text, want", [
    ("She makes $1,234.50 a week.", 1234.5),
    ("The answer is 18.", 18.0),
    ("so the total is -7", -7.0),
    ("x = -2.5", -2.5),
    ("5-3=2", 2.0),  # a binary minus is not a sign
    ("pages 10-12", 12.0),
    ("1,234,567 apples", 1234567.0),
    ("3, 4, 5", 5.0),  # list commas are not thousands separators
    ("step 1: 40 / 2 = 20\nThe answer is 20 dollars", 20.0),
    ("no number here", None),
    ("", None),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_gold_and_correct():
    assert gold_answer("Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18") == 18.0
    assert gold_answer("... #### 1,000") == 1000.0
    assert gold_answer("#### -3") == -3.0
    assert gold_answer("no mark 5") is None
    assert is_correct(18.0, 18.0) and is_correct(1234.50, 1234.5)
    assert not is_correct(None, 18.0) and not is_correct(18.01, 18.0) and not is_correct(18.0, None)


def test_load_gsm8k(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"question": "a?", "answer": "x #### 3"}) + "\n\n"
                 + json.dumps({"question": "b?", "answer": "y #### 4,500"}) + "\n"
                 + json.dumps({"question": "c?"}) + "\n")  # no answer: a training prompt, gold None
    assert load_gsm8k(str(p)) == [Question(0, "a?", 3.0), Question(2, "b?", 4500.0), Question(3, "c?", None)]
    assert load_gsm8k(str(p), 1) == [Question(0, "a?", 3.0)]
    assert solve_turns(load_gsm8k(str(p), 1)) == ["a?\nSolve it step by step, then give the final answer as a number."]
    p.write_text(json.dumps({"question": "a?", "answer": "no mark"}) + "\n")
    with pytest.raises(ValueError, match="no number after"):
        load_gsm8k(str(p))
    p.write_text("\n")
    with pytest.raises(ValueError, match="no questions"):
        load_gsm8k(str(p))


def test_a_missing_gsm8k_file_is_a_clear_exit_of_a_tool(tmp_path, capsys):
    from lightllm.tools.prompts import DataFileNotFound, load_gsm8k, run_tool

    missing = str(tmp_path / "none.jsonl")
    with pytest.raises(DataFileNotFound, match=f"GSM8K file {missing} not found.*LIGHTLLM_GSM8K_DIR"):
        load_gsm8k(missing)
    with pytest.raises(SystemExit) as e:
        run_tool(lambda: load_gsm8k(missing))
    assert str(e.value.code).startswith(f"error: GSM8K file {missing} not found")  # the message, no traceback
    for returned, status in ((3, 3), (None, 0), (object(), 0)):  # an int is the status; anything else is 0
        with pytest.raises(SystemExit) as e:
            run_tool(lambda: returned)
        assert e.value.code == status
    with pytest.raises(FileNotFoundError):  # other errors keep their traceback
        run_tool(lambda: open(missing))


def test_real_gsm8k_golds_all_parse():
    qs = load_gsm8k(require_gsm8k("test"))
    assert len(qs) == 1319 and qs[0].gold == 18.0


def test_gsm8k_path_from_the_argument_the_environment_or_beside_the_checkout(monkeypatch):
    monkeypatch.delenv(prompts.GSM8K_DIR_ENV, raising=False)
    beside = os.path.join(prompts.REPO, "..", "shared", "data", "gsm8k", "train.jsonl")
    assert gsm8k_path("train") == beside
    monkeypatch.setenv(prompts.GSM8K_DIR_ENV, "/data/g")
    assert gsm8k_path("test") == "/data/g/test.jsonl"
    assert gsm8k_path("test", "given.jsonl") == "given.jsonl"


def test_prompt_file_and_cycling(tmp_path):
    pf = tmp_path / "prompts.txt"
    pf.write_text('plain line\n\n"two\\nlines"\nthird\n')
    assert load_prompt_file(str(pf), 10) == ["plain line", "two\nlines", "third"]
    assert load_prompt_file(str(pf), 2) == ["plain line", "two\nlines"]
    assert take_cyclic(["a", "b"], 5) == ["a", "b", "a", "b", "a"]
    with pytest.raises(ValueError, match="no prompts"):
        take_cyclic([], 1)


@pytest.mark.parametrize("adds_bos", [False, True])
def test_generate_text_tokenizes_to_the_chat_endpoints_ids(adds_bos):
    tok = FakeTokenizer(adds_bos)
    [ids] = chat_prompt_ids(tok, ["What is 2+2?"])
    assert ids == [1] + [ord(c) for c in "user: What is 2+2?\nassistant: "]  # the template's one BOS, nothing added
    [text] = chat_prompt_texts(tok, ["What is 2+2?"])
    assert text == ("user: " if adds_bos else "<s>user: ") + "What is 2+2?\nassistant: "
    assert tok.encode(text, add_special_tokens=True) == ids  # what /generate makes of it


def test_the_embedded_models_prompts_add_nothing_to_the_template():
    from transformers import AutoTokenizer

    from lightllm.utils.embedded_model import get_default_model_dir

    try:
        tok = AutoTokenizer.from_pretrained(get_default_model_dir())
    except FileNotFoundError as e:
        pytest.skip(f"embedded model unavailable: {e}")
    [ids] = chat_prompt_ids(tok, ["What is 2 + 3?"])
    [text] = chat_prompt_texts(tok, ["What is 2 + 3?"])
    template = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                       tokenize=False)
    assert tok.decode(ids) == template == text and template.endswith("<|im_start|>assistant\n")
    assert tok.encode(text, add_special_tokens=True) == ids
