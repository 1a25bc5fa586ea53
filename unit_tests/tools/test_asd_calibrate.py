"""asd_calibrate: first-rejection ratios and q25 by hand; the CLI flow with a fake engine; one real CPU run (slow)."""
import json
import math
import os

import numpy as np
import pytest
import torch

from lightllm.server.router.model_infer.mtp_speculative.utils import VerifyStepRecord
from lightllm.tools import asd_calibrate
from lightllm.tools.asd_calibrate import (
    CalibrationError,
    check_train_split,
    first_rejection_ratios,
    q25,
    suggested_flags,
)
from unit_tests.data_paths import require_gsm8k
from unit_tests.tools.fakes import FakeTokenizer, write_gsm8k

NO_DRAFT = -1
K = 3
VOCAB = 5


def _record(drafts, targets, logits, k=K) -> VerifyStepRecord:
    rows = len(drafts)
    return VerifyStepRecord(
        mtp_step=k,
        b_req_idx=torch.arange(rows // (k + 1), dtype=torch.int32).repeat_interleave(k + 1),
        drafts=torch.tensor(drafts, dtype=torch.int64),
        target_ids=torch.tensor(targets, dtype=torch.int64),
        committed_ids=torch.tensor(targets, dtype=torch.int64),
        processed_logits=torch.tensor(logits, dtype=torch.float32),
        accept_len=torch.ones(rows // (k + 1), dtype=torch.int32),
    )


def _hand_built_step() -> VerifyStepRecord:
    """Seven requests of K + 1 = 4 rows; every logit row is 0 except the entries named."""
    drafts, targets, logits = [], [], []

    def req(d, t, z):  # d, t: 4 tokens each (row 3 is the bonus row); z: {row: {token: logit}}
        drafts.extend(d)
        targets.extend(t)
        for j in range(K + 1):
            row = [0.0] * VOCAB
            for tok, v in z.get(j, {}).items():
                row[tok] = v
            logits.append(row)

    # 0: first mismatch at j = 1: r = 2.5 - 0.5 = 2.0, value K - j = 2 -> 1.0 (j = 2 also misses: ignored)
    req([2, 3, 1, NO_DRAFT], [2, 4, 0, 1], {1: {4: 2.5, 3: 0.5}, 2: {0: 9.0}})
    # 1: every draft matches -> nothing
    req([1, 1, 1, NO_DRAFT], [1, 1, 1, 3], {})
    # 2: first mismatch has no real draft (-1) -> nothing
    req([NO_DRAFT, 2, 2, NO_DRAFT], [0, 2, 2, 2], {0: {0: 1.0}})
    # 3: mismatch on a tie (z[d] == z[t]) -> ratio 0, not kept
    req([3, 0, 0, NO_DRAFT], [2, 0, 0, 0], {0: {2: 1.0, 3: 1.0}})
    # 4: first mismatch at j = 2: r = 1.0 - (-0.5) = 1.5, value 1 -> 1.5
    req([4, 4, 0, NO_DRAFT], [4, 4, 1, 2], {2: {1: 1.0, 0: -0.5}})
    # 5: draft id >= vocab -> never read, nothing
    req([7, 1, 1, NO_DRAFT], [0, 1, 1, 1], {0: {0: 4.0}})
    # 6: first mismatch at j = 0: r = 3.0 - 1.2 = 1.8, value 3 -> 0.6
    req([2, 1, 1, NO_DRAFT], [0, 1, 1, 1], {0: {0: 3.0, 2: 1.2}})
    return _record(drafts, targets, logits)


def test_first_rejection_ratios_by_hand():
    got = first_rejection_ratios(_hand_built_step())
    assert got == pytest.approx([1.0, 1.5, 0.6], abs=1e-6)


def test_first_rejection_ratios_edge_cases():
    # one request, all drafts missing (the step right after prefill): nothing
    rec = _record([NO_DRAFT] * 4, [1, 2, 3, 4], [[0.0] * VOCAB] * 4)
    assert first_rejection_ratios(rec) == []
    # K = 1: value is 1 at j = 0
    rec = _record([3, NO_DRAFT], [1, 0], [[0.0, 2.0, 0.0, -1.0, 0.0], [0.0] * VOCAB], k=1)
    assert first_rejection_ratios(rec) == pytest.approx([3.0])
    with pytest.raises(ValueError, match="whole number of requests"):
        first_rejection_ratios(_record([1, 2, 3], [1, 2, 3], [[0.0] * VOCAB] * 3))


def test_q25_linear_interpolation_by_hand():
    # n = 5: h = 4 * 0.25 = 1 -> the 2nd smallest
    assert q25([5.0, 1.0, 4.0, 2.0, 3.0]) == 2.0
    # n = 4: h = 0.75 -> 1 + 0.75 * (2 - 1)
    assert q25([4.0, 1.0, 3.0, 2.0]) == pytest.approx(1.75)
    # n = 6: h = 1.25 -> 0.2 + 0.25 * (0.6 - 0.2) = 0.3
    assert q25([0.9, 0.1, 0.6, 0.2, 5.0, 0.8]) == pytest.approx(0.3)
    assert q25([0.7]) == 0.7
    rng = np.random.default_rng(0)
    for n in (2, 3, 10, 101):
        v = rng.exponential(size=n).tolist()
        assert q25(v) == pytest.approx(float(np.quantile(v, 0.25)), rel=1e-12)
        assert q25(v) == pytest.approx(float(torch.quantile(torch.tensor(v, dtype=torch.float64), 0.25)), rel=1e-12)
    with pytest.raises(ValueError, match="empty"):
        q25([])


def test_small_helpers():
    assert suggested_flags(0.25) == ("--mtp_asd_regret_budget 0.25 --mtp_asd_local_regret_ratio 0.25 "
                                     "--mtp_asd_block_max_mismatch 1")
    check_train_split("/data/gsm8k/train.jsonl")
    with pytest.raises(CalibrationError, match="TRAIN"):
        check_train_split("/data/gsm8k/test.jsonl")


# ---- the CLI flow, with the engine replaced by a fake ----


class FakeResult:
    def __init__(self, ids):
        self.token_ids = ids


@pytest.fixture
def fake_engine(monkeypatch, tmp_path):
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda d: FakeTokenizer())
    calls = []

    def fake_generate(args, asd_budget, max_len, prompts, params, observer=None):
        calls.append(asd_budget)
        if observer is not None:
            observer(_hand_built_step())
            observer(_hand_built_step())
        outs = [[10, 11, 12 + i] for i in range(len(prompts))]
        if asd_budget == 0.0 and fake_generate.break_b0:
            outs[2] = [10, 99, 14]
        return [FakeResult(o) for o in outs]

    fake_generate.break_b0 = False
    monkeypatch.setattr(asd_calibrate, "_generate", fake_generate)
    data = write_gsm8k(tmp_path / "train.jsonl", 5)
    (tmp_path / "model").mkdir()
    return fake_generate, calls, data, str(tmp_path)


def test_cli_writes_q25_and_flags(fake_engine, capsys):
    fake, calls, data, tmp = fake_engine
    out = os.path.join(tmp, "calib.json")
    rc = asd_calibrate.main(["--data", data, "--num_questions", "4", "--model_dir", os.path.join(tmp, "model"),
                             "--out", out])
    assert rc == 0 and calls == [None, 0.0]  # strict first (observed), then B = 0
    calib = json.load(open(out))
    # ratios [1.0, 1.5, 0.6] twice -> sorted [.6 .6 1 1 1.5 1.5], h = 1.25 -> 0.6 + 0.25 * 0.4
    assert calib["count"] == 6 and calib["q25"] == pytest.approx(0.7, abs=1e-6)
    assert calib["num_questions"] == 4 and calib["verify_steps"] == 2 and calib["b0_identical"] is True
    assert calib["suggested_flags"] == suggested_flags(calib["q25"])
    printed = capsys.readouterr().out
    assert f"q25 = {calib['q25']!r}" in printed and "--mtp_asd_block_max_mismatch 1" in printed


def test_cli_refuses_when_b0_differs(fake_engine, capsys):
    fake, calls, data, tmp = fake_engine
    fake.break_b0 = True
    out = os.path.join(tmp, "calib.json")
    rc = asd_calibrate.main(["--data", data, "--num_questions", "4", "--model_dir", os.path.join(tmp, "model"),
                             "--out", out])
    err = capsys.readouterr().err
    assert rc != 0 and not os.path.exists(out)
    assert "request 2 (question 2" in err and "token position 1" in err and "Refusing" in err


def test_cli_refuses_test_split(fake_engine, capsys, tmp_path):
    fake, calls, data, tmp = fake_engine
    test_file = tmp_path / "test.jsonl"
    test_file.write_text(open(data).read())
    assert asd_calibrate.main(["--data", str(test_file), "--model_dir", os.path.join(tmp, "model"),
                               "--out", os.path.join(tmp, "c.json")]) != 0
    assert "never test" in capsys.readouterr().err and calls == []


# ---- one real run on CPU: the embedded model, a random eagle_with_att draft ----


@pytest.mark.slow
def test_real_calibration_run_on_cpu(tmp_path):
    from transformers import AutoConfig

    from lightllm.models.llama_mtp.train_module import random_draft
    from lightllm.utils.embedded_model import get_default_model_dir

    model_dir = get_default_model_dir()
    draft = random_draft(AutoConfig.from_pretrained(model_dir), str(tmp_path / "draft"), True, 1, seed=0)
    out = tmp_path / "calib.json"
    rc = asd_calibrate.main(["--data", require_gsm8k("train"), "--num_questions", "4", "--max_new_tokens", "16",
                             "--mtp_step", "2", "--mtp_draft_model_dir", draft, "--out", str(out)])
    assert rc == 0
    calib = json.load(open(out))
    assert calib["b0_identical"] and calib["count"] > 0 and calib["verify_steps"] > 0
    assert math.isfinite(calib["q25"]) and calib["q25"] > 0
    assert calib["ratio_min"] <= calib["q25"] <= calib["ratio_max"]
