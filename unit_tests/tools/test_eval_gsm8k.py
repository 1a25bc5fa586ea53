"""eval_gsm8k: arms, aggregation and rendering by hand; the CLI flow with a fake server;
one real run against real servers on CPU (slow). Answers and prompts: test_prompts.py."""
import json
import os
from types import SimpleNamespace

import pytest

from lightllm.tools import eval_gsm8k
from lightllm.tools.client import USAGE, AsdSetting
from lightllm.tools.eval_gsm8k import (
    Arm,
    ArmRun,
    RequestRecord,
    add_speedups_vs_strict_and_b0,
    build_arms,
    check_b0,
    check_same_draft,
    differing_requests,
    parse_float_list,
    render_markdown,
    summarize_arm,
    throughput_noise_note,
)
from unit_tests.data_paths import require_gsm8k
from unit_tests.tools.fakes import FakeTokenizer, write_gsm8k


# ---- arms ----


def test_build_arms_and_flags():
    arms = build_arms(["strict", "asd_b0", "asd_q25", "asd_usage"], 0.3, [0.5, 8], with_baseline=True)
    assert [a.name for a in arms] == ["strict", "asd_b0", "asd_q25", "asd_usage", "asd_B0.5", "asd_B8", "baseline"]
    by = {a.name: a for a in arms}
    assert by["baseline"].server_flags("eagle_with_att", 3, ["/d"]) == []
    assert by["strict"].server_flags("eagle_with_att", 3, ["/d"]) == [
        "--mtp_mode", "eagle_with_att", "--mtp_step", "3", "--mtp_draft_model_dir", "/d"]
    assert by["asd_b0"].server_flags("eagle_with_att", 2, None) == [
        "--mtp_mode", "eagle_with_att", "--mtp_step", "2", "--mtp_asd_regret_budget", "0.0"]
    assert by["asd_q25"].server_flags("eagle_with_att", 3, None)[4:] == [
        "--mtp_asd_regret_budget", "0.3", "--mtp_asd_local_regret_ratio", "0.3", "--mtp_asd_block_max_mismatch", "1"]
    assert by["asd_usage"].server_flags("eagle_with_att", 3, None)[4:] == [
        "--mtp_asd_regret_budget", "2.0625", "--mtp_asd_local_regret_ratio", "0.25", "--mtp_asd_block_max_mismatch", "2"]
    assert by["asd_B8"].asd == AsdSetting(8.0, 0.25, 2) and by["asd_usage"].asd == USAGE
    assert [a.name for a in build_arms(["strict", "asd_b0"], None, [], False)] == ["strict", "asd_b0"]


@pytest.mark.parametrize("named, q, sweep, msg", [
    (["strict"], None, [], "'asd_b0' is required"),
    (["asd_b0", "asd_usage"], None, [], "'strict' is required"),
    (["strict", "asd_b0", "asd_q25"], None, [], "needs --calib"),
    (["strict", "asd_b0", "bogus"], None, [], "unknown arm 'bogus'"),
    (["strict", "asd_b0"], None, [1.0, 1.0], "given twice"),
    (["strict", "asd_b0"], None, [-1.0], "finite and >= 0"),
])
def test_build_arms_errors(named, q, sweep, msg):
    with pytest.raises(ValueError, match=msg):
        build_arms(named, q, sweep, False)


def test_parse_float_list():
    assert parse_float_list("0.5,1, 2") == [0.5, 1.0, 2.0]
    assert parse_float_list("") == []


# ---- aggregation ----


def _rec(i, ids, count=None, acc=0, relaxed=0, regret=0.0, correct=True):
    count = len(ids) if count is None else count
    return RequestRecord(i, list(ids), "t", count, acc, relaxed, regret, "eos", 1.0 if correct else 2.0, 1.0, correct)


def test_summarize_arm_by_hand():
    strict = [_rec(0, [1] * 10), _rec(1, [2] * 20), _rec(2, [3] * 6)]
    arm = [
        _rec(0, [1] * 10, acc=6, relaxed=2, regret=0.5),
        _rec(1, [2] * 19 + [9], acc=10, correct=False),  # differs from strict
        _rec(2, [3] * 6, acc=0, relaxed=1, regret=1.0),
    ]
    s = summarize_arm(Arm("asd_usage", asd=USAGE), arm, 4.0, strict,
                      {1: 2, 2: 1, 3: 1}, engine_s=3.0)
    assert (s.budget, s.local_ratio, s.max_mismatch) == (2.0625, 0.25, 2)
    assert s.num_requests == 3 and s.accuracy == pytest.approx(2 / 3)
    # 36 tokens over (10-6) + (20-10) + (6-0) = 20 steps
    assert s.output_tokens == 36 and s.tokens_per_step == pytest.approx(1.8)
    assert s.output_tokens_per_s == pytest.approx(9.0) and s.requests_per_s == pytest.approx(0.75)
    assert s.differs_from_strict == pytest.approx(1 / 3)
    assert s.mean_regret_spent == pytest.approx(0.5) and s.mean_relaxed_tokens == pytest.approx(1.0)
    assert s.mean_accept_len == pytest.approx((2 * 1 + 2 + 3) / 4)
    assert s.engine_tokens_per_s == pytest.approx(12.0)  # 36 tokens in 3 s of batch steps
    st = summarize_arm(Arm("strict"), strict, 6.0, strict, engine_s=4.0)  # 9 tok/s on the engine's clock
    assert st.differs_from_strict is None and st.tokens_per_step == 1.0 and st.mean_accept_len is None
    add_speedups_vs_strict_and_b0([st, s])
    assert st.speedup_vs_strict == 1.0 and s.speedup_vs_strict == pytest.approx(9.0 / 6.0)
    assert s.requests_per_s_vs_strict == pytest.approx(0.75 / 0.5)
    assert s.engine_speedup_vs_strict == pytest.approx(12.0 / 9.0) and s.engine_speedup_vs_b0 is None
    no_clock = summarize_arm(Arm("asd_b0", asd=AsdSetting(0.0)), strict, 6.0, strict)  # a server without the metric
    add_speedups_vs_strict_and_b0([st, no_clock])
    assert no_clock.engine_tokens_per_s is None and no_clock.engine_speedup_vs_strict is None


def test_differences_and_b0_check():
    strict = [_rec(0, [1, 2, 3]), _rec(5, [4, 5]), _rec(7, [6])]
    same = [_rec(0, [1, 2, 3]), _rec(5, [4, 5]), _rec(7, [6])]
    other = [_rec(0, [1, 2, 3]), _rec(5, [4, 5, 8]), _rec(7, [9])]
    assert differing_requests(same, strict) == [] and differing_requests(other, strict) == [1, 2]
    ok = check_b0(strict, same)
    assert ok.passed and "PASSED" in ok.message() and "all 3 requests" in ok.message()
    bad = check_b0(strict, other)
    assert not bad.passed and bad.num_differing == 2
    assert (bad.first_question_index, bad.first_token_position) == (5, 2)  # prefix: the shorter length
    assert "question 5, token position 2" in bad.message()
    with pytest.raises(ValueError, match="order differs"):
        differing_requests([_rec(1, [1])], [_rec(0, [1])])
    with pytest.raises(ValueError, match="request counts"):
        differing_requests([_rec(0, [1])], [])


def test_ratios_to_b0_and_the_noise_note():
    strict = [_rec(0, [1, 2]), _rec(1, [3])]  # 3 tokens
    st = summarize_arm(Arm("strict"), strict, 1.0, strict, engine_s=0.5)  # 3 tok/s, engine 6
    b0 = summarize_arm(Arm("asd_b0", asd=AsdSetting(0.0)), strict, 1.0 / 1.02, strict, engine_s=0.6)  # 3.06 tok/s: 1.020x
    asd = summarize_arm(Arm("asd_usage", asd=AsdSetting(2.0)), strict, 0.5, strict)  # 6 tok/s
    assert throughput_noise_note([st, asd]) is None  # no B = 0 arm
    add_speedups_vs_strict_and_b0([st, b0, asd])
    assert asd.speedup_vs_b0 == pytest.approx(6.0 / 3.06) and b0.speedup_vs_b0 == pytest.approx(1.0)
    quiet = throughput_noise_note([st, b0, asd])
    assert not quiet.startswith("WARNING") and "1.020x" in quiet and "within 0.020 of 1" in quiet
    assert "On the engine's clock B = 0 measured 0.833x strict." in quiet  # 5 vs 6 tok/s
    b0.speedup_vs_strict = 1.145  # the third session's K = 3 run
    loud = throughput_noise_note([st, b0, asd])
    assert loud.startswith("WARNING") and "1.145x" in loud and "within 0.145 of 1" in loud
    md = render_markdown([st, b0, asd], check_b0(strict, strict), "cmd", {})
    assert "**WARNING: Throughput noise check" in md and "tok/s vs B=0" in md


def test_render_markdown():
    strict = [_rec(0, [1, 2]), _rec(1, [3])]
    sums = [summarize_arm(Arm("strict"), strict, 1.0, strict, engine_s=0.5),
            summarize_arm(Arm("asd_b0", asd=AsdSetting(0.0)), strict, 0.5, strict, engine_s=0.25)]
    add_speedups_vs_strict_and_b0(sums)
    md = render_markdown(sums, check_b0(strict, strict), "python -m lightllm.tools.eval_gsm8k --data x", {"K": 3})
    lines = md.splitlines()
    assert "- K: 3" in lines and "**B = 0 identity check PASSED" in md
    header = next(l for l in lines if l.startswith("| arm |"))
    assert "accuracy" in header and "out tok/s" in header and "differs from strict" in header
    row = next(l for l in lines if l.startswith("| asd_b0 |"))
    assert "| 0 | - | - | 100.00% |" in row and "| 2.000x |" in row and "| 0.0% |" in row
    assert "| 1.000x | 12.0 | 2.000x | 1.000x |" in row  # tok/s vs B=0, engine tok/s, vs strict, vs B=0
    assert "engine tok/s" in header
    assert "```\npython -m lightllm.tools.eval_gsm8k --data x\n```" in md
    assert "NOT RUN" in render_markdown(sums, None, "cmd", {})


# ---- the CLI flow with a fake server ----


@pytest.fixture
def fake_server(monkeypatch, tmp_path):
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda d: FakeTokenizer(adds_bos=False))
    seen = {}

    def fake_run_arm(arm, base_flags, arm_flags, questions, prompts, args, out_dir, draft_check_dirs=None):
        seen[arm.name] = (base_flags, arm_flags, list(prompts))
        if fake_run_arm.before_arm is not None:
            fake_run_arm.before_arm(arm)
        recs = []
        for j, q in enumerate(questions):
            ids = [q.index, 7, 8]
            budget = arm.asd.budget if arm.asd else None
            if budget and j == 1 or arm.name == "asd_b0" and fake_run_arm.break_b0 and j == 2:
                ids = ids + [9]
            text = f"so the answer is {q.gold:g}" if j != 0 else "no idea"
            recs.append(RequestRecord.from_response(q, {
                "generated_text": [text], "count_output_tokens": len(ids), "finish_reason": "eos",
                "mtp_accepted_token_num": 1 if arm.mtp else 0, "asd_relaxed_token_num": 1 if budget else 0,
                "asd_regret_spent": 0.5 if budget else 0.0, "tokens": [{"id": t} for t in ids]}))
        hist = {1: 3, 2: 2} if arm.mtp else {1: 5}
        digest = eval_gsm8k.files_digest(draft_check_dirs) if arm.mtp and draft_check_dirs else None
        return ArmRun(recs, 2.0 if arm.name == "strict" else 1.0, hist, draft_digest=digest, engine_s=0.5)

    fake_run_arm.break_b0 = False
    fake_run_arm.before_arm = None
    monkeypatch.setattr(eval_gsm8k, "run_arm", fake_run_arm)
    data = write_gsm8k(tmp_path / "test.jsonl", 4, first_gold=1)
    (tmp_path / "model").mkdir()
    return fake_run_arm, seen, data, str(tmp_path)


def test_cli_flow_writes_results(fake_server):
    fake, seen, data, tmp = fake_server
    out = os.path.join(tmp, "out")
    argv = ["--data", data, "--out_dir", out, "--model_dir", os.path.join(tmp, "model"), "--q25", "0.3",
            "--sweep", "1,4", "--with_baseline", "--concurrency", "8", "--mtp_step", "2"]
    assert eval_gsm8k.main(argv) == 0
    assert list(seen) == ["strict", "asd_b0", "asd_q25", "asd_usage", "asd_B1", "asd_B4", "baseline"]
    base, flags, prompts = seen["asd_q25"]
    assert base[:2] == ["--model_dir", os.path.join(tmp, "model")] and "--running_max_req_size" in base
    assert base[base.index("--running_max_req_size") + 1] == "8"
    assert base[base.index("--batch_max_tokens") + 1] == "4096"
    assert flags == ["--mtp_mode", "eagle_with_att", "--mtp_step", "2", "--mtp_asd_regret_budget", "0.3",
                     "--mtp_asd_local_regret_ratio", "0.3", "--mtp_asd_block_max_mismatch", "1"]
    assert prompts[0].startswith("<s>user: q0?")
    res = json.load(open(os.path.join(out, "results.json")))
    assert res["b0_check"]["passed"] and res["command"].endswith(" ".join(argv)) and res["skipped_arms"] == []
    arms = {a["name"]: a for a in res["arms"]}
    assert arms["strict"]["accuracy"] == pytest.approx(0.75)  # question 0 has no number
    assert arms["asd_usage"]["differs_from_strict"] == pytest.approx(0.25)
    # 13 tokens in 1 s (question 1 got one token more) vs strict's 12 in 2 s
    assert arms["asd_usage"]["speedup_vs_strict"] == pytest.approx(13 / 6)
    assert arms["asd_b0"]["speedup_vs_strict"] == pytest.approx(2.0)
    assert arms["strict"]["tokens_per_step"] == pytest.approx(12 / 8)
    assert arms["baseline"]["tokens_per_step"] == pytest.approx(1.0)
    for f in ("results.md", "budget_sweep.png", "accept_len_hist.png"):
        assert os.path.getsize(os.path.join(out, f)) > 0
    assert "| asd_q25 | 0.3 | 0.3 | 1 |" in open(os.path.join(out, "results.md")).read()


def test_cli_flow_fails_loudly_when_b0_differs(fake_server, capsys):
    fake, seen, data, tmp = fake_server
    fake.break_b0 = True
    out = os.path.join(tmp, "out")
    rc = eval_gsm8k.main(["--data", data, "--out_dir", out, "--model_dir", os.path.join(tmp, "model"),
                          "--sweep", ""])
    assert rc == 1 and list(seen) == ["strict", "asd_b0", "asd_usage"]  # no q: no asd_q25 arm
    res = json.load(open(os.path.join(out, "results.json")))  # written before failing
    assert not res["b0_check"]["passed"] and res["b0_check"]["first_question_index"] == 2
    assert "FAILED" in capsys.readouterr().err
    assert "identity check FAILED" in open(os.path.join(out, "results.md")).read()


def test_files_digest_by_hand(tmp_path):
    import hashlib

    (tmp_path / "b.bin").write_bytes(b"\x01\x02")
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "sub").mkdir()  # not a file: ignored
    want = hashlib.sha256(b"a.json\0{}" + b"b.bin\0\x01\x02").hexdigest()[:16]
    assert eval_gsm8k.files_digest([str(tmp_path)]) == want
    (tmp_path / "b.bin").write_bytes(b"\x01\x03")
    assert eval_gsm8k.files_digest([str(tmp_path)]) != want
    assert check_same_draft({"strict": "x", "asd_b0": "x", "baseline": None}) is None
    msg = check_same_draft({"strict": "x", "asd_b0": "x", "asd_B8": "y"})
    assert "changed during the run" in msg and "asd_B8 y" in msg


def test_cli_flow_fails_when_the_draft_changes_between_arms(fake_server, capsys):
    # the second session's B = 8 arm ran with other draft weights than strict: this catches it
    fake, seen, data, tmp = fake_server
    draft = os.path.join(tmp, "draft")
    os.mkdir(draft)
    with open(os.path.join(draft, "model.safetensors"), "wb") as f:
        f.write(b"new weights")

    def overwrite(arm):
        if arm.name == "asd_usage":
            with open(os.path.join(draft, "model.safetensors"), "wb") as f:
                f.write(b"old weights")

    fake.before_arm = overwrite
    out = os.path.join(tmp, "out")
    rc = eval_gsm8k.main(["--data", data, "--out_dir", out, "--model_dir", os.path.join(tmp, "model"),
                          "--mtp_draft_model_dir", draft, "--sweep", ""])
    assert rc == 1 and "the draft files changed during the run" in capsys.readouterr().err
    res = json.load(open(os.path.join(out, "results.json")))
    digests = {a["name"]: a["draft_digest"] for a in res["arms"]}
    assert digests["strict"] == digests["asd_b0"] != digests["asd_usage"]
    assert "MISMATCH" in open(os.path.join(out, "results.md")).read()


def test_time_budget_skips_only_optional_arms(fake_server, monkeypatch):
    fake, seen, data, tmp = fake_server
    clock = iter(range(0, 1000, 10))  # every perf_counter call advances 10 s
    monkeypatch.setattr(eval_gsm8k, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    out = os.path.join(tmp, "out")
    assert eval_gsm8k.main(["--data", data, "--out_dir", out, "--model_dir", os.path.join(tmp, "model"),
                            "--q25", "0.3", "--time_budget_s", "1"]) == 0
    assert list(seen) == ["strict", "asd_b0"]
    res = json.load(open(os.path.join(out, "results.json")))
    assert res["skipped_arms"] == ["asd_q25", "asd_usage", "asd_B0.5", "asd_B1", "asd_B2", "asd_B4", "asd_B8"]
    assert [a["name"] for a in res["arms"]] == ["strict", "asd_b0"] and res["b0_check"]["passed"]


def test_cli_rejects_missing_q_for_q25_arm(fake_server, capsys):
    fake, seen, data, tmp = fake_server
    rc = eval_gsm8k.main(["--data", data, "--out_dir", os.path.join(tmp, "o"), "--arms", "strict,asd_b0,asd_q25"])
    assert rc == 2 and "needs --calib" in capsys.readouterr().err and not seen


def test_calib_file_feeds_q25(fake_server, tmp_path):
    fake, seen, data, tmp = fake_server
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps({"q25": 0.125, "mtp_step": 3}))
    assert eval_gsm8k.main(["--data", data, "--out_dir", os.path.join(tmp, "o"), "--model_dir",
                            os.path.join(tmp, "model"), "--calib", str(calib), "--sweep", ""]) == 0
    assert seen["asd_q25"][1][4:] == ["--mtp_asd_regret_budget", "0.125", "--mtp_asd_local_regret_ratio", "0.125",
                                      "--mtp_asd_block_max_mismatch", "1"]


# ---- one real run on CPU: real servers, the embedded model, a random eagle_with_att draft ----


@pytest.mark.slow
def test_real_eval_run_on_cpu(tmp_path):
    from transformers import AutoConfig

    from lightllm.models.llama_mtp.train_module import random_draft
    from lightllm.utils.embedded_model import get_default_model_dir

    model_dir = get_default_model_dir()
    draft = random_draft(AutoConfig.from_pretrained(model_dir), str(tmp_path / "draft"), True, 1, seed=0)
    out = tmp_path / "out"
    rc = eval_gsm8k.main(["--data", require_gsm8k("test"), "--out_dir", str(out), "--num_questions", "4",
                          "--max_new_tokens", "16", "--mtp_step", "2", "--mtp_draft_model_dir", draft,
                          "--concurrency", "4", "--q25", "0.5", "--sweep", "", "--warmup", "1"])
    assert rc == 0
    res = json.load(open(out / "results.json"))
    assert res["b0_check"]["passed"] and res["b0_check"]["num_requests"] == 4
    arms = {a["name"]: a for a in res["arms"]}
    assert list(arms) == ["strict", "asd_b0", "asd_q25", "asd_usage"]
    for a in arms.values():
        assert a["num_requests"] == 4 and 0 < a["output_tokens"] <= 4 * 16 and a["output_tokens_per_s"] > 0
        assert 1.0 <= a["tokens_per_step"] <= 3.0
        assert sum(a["accept_len_hist"].values()) > 0  # this arm's decode steps, warm-up excluded
        assert a["mean_regret_spent"] <= (a["budget"] or 0.0) + 1e-6
        assert a["draft_digest"] == eval_gsm8k.files_digest([draft])  # before and after every server
    assert arms["asd_b0"]["differs_from_strict"] == 0.0
    recs = [json.loads(l) for l in open(out / "requests_strict.jsonl")]
    assert len(recs) == 4 and all(len(r["token_ids"]) == r["count_output_tokens"] for r in recs)
    for f in ("results.md", "budget_sweep.png", "accept_len_hist.png", "server_strict.log"):
        assert (out / f).stat().st_size > 0
