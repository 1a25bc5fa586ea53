"""benchmarks/bench_mtp_draft_quality.py on a tiny random Llama (CPU): tokens per step by prompt
set and K for two drafts in one run, the table, and the count of requests that differ from no-MTP."""
import importlib.util
import json
import os

import pytest
import torch

from unit_tests.models.tiny_checkpoints import random_prompts, tiny_model
from unit_tests.tools.test_magpie_prompts import tiny_tokenizer

_spec = importlib.util.spec_from_file_location(
    "bench_mtp_draft_quality",
    os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_mtp_draft_quality.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

STEPS = [1, 2]
NEW_TOKENS = 8
HELDOUT_ROWS = [{"id": f"{kind}-{i}", "kind": kind, "prompt": f"w{200 + 10 * j + i} w{201 + 10 * j + i} w5",
                 "source": "test"} for j, kind in enumerate(("code", "advice", "math")) for i in range(2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    model = tiny_model("llama", tmp_path_factory.mktemp("quality"))
    tiny_tokenizer().save_pretrained(model.model_dir)  # the engine reads the eos tokens through it
    return model, model.draft("old", seed=1), model.draft("new", seed=2)


def test_measure_reports_tokens_per_step_by_set_for_each_draft(tiny):
    model, old, new = tiny
    prompts = random_prompts(model.vocab_size, 6, range(4, 10))
    groups = [bench.GSM8K_TEST] * 2 + ["code"] * 2 + ["math"] * 2
    rows = bench.measure(model.model_dir, prompts, groups, [old, new], STEPS, "eagle_with_att", NEW_TOKENS)
    assert [(r["draft"], r["mtp_step"]) for r in rows] == [("-", 0), (old, 1), (old, 2), (new, 1), (new, 2)]
    for r in rows[1:]:
        by_set = r["tokens_per_step_by_set"]
        assert set(by_set) == {bench.GSM8K_TEST, "code", "math", bench.NON_MATH}
        assert by_set[bench.NON_MATH] == by_set["code"]  # the only non-math held-out kind here
        assert all(1.0 <= v <= 1 + r["mtp_step"] for v in by_set.values())
        assert r["requests_differing_from_no_mtp"] == 0  # strict, fp32 on CPU
        assert "token_ids" not in r
    table = bench.set_table(rows, new)
    assert "K=1" in table and "K=2" in table and bench.NON_MATH in table and old not in table


def test_main_writes_both_drafts_and_the_heldout_table(tiny, tmp_path, capsys):
    model, old, new = tiny
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps(r) + "\n" for r in HELDOUT_ROWS))
    out = bench.main(["--model_dir", model.model_dir, "--num_questions", "0", "--heldout", str(heldout),
                      "--draft_dir", old, new, "--steps", *map(str, STEPS), "--max_new_tokens", str(NEW_TOKENS),
                      "--out", str(tmp_path / "q.json")])
    saved = json.loads((tmp_path / "q.json").read_text())
    assert saved["drafts"] == [old, new] and saved["heldout_prompts"] == len(HELDOUT_ROWS)
    assert not os.path.isabs(saved["heldout"]) and out["num_questions"] == 0
    assert set(saved["tokens_per_step_tables"]) == {old, new}
    assert set(saved["rows"][1]["tokens_per_step_by_set"]) == {"code", "advice", "math", bench.NON_MATH}
    printed = capsys.readouterr().out
    assert f"{new}: set" in printed and "advice" in printed and "differ from no-MTP" in printed


def test_asd_usage_arms_sit_beside_the_strict_ones(tiny):
    model, old, _ = tiny
    prompts = random_prompts(model.vocab_size, 4, range(4, 10))
    groups = ["code"] * 4
    rows = bench.measure(model.model_dir, prompts, groups, [old], [2], "eagle_with_att", NEW_TOKENS, asd_usage=True)
    assert [r["arm"] for r in rows] == ["no_mtp", "eagle_with_att_k2", "eagle_with_att_k2_asd_usage"]
    strict, usage = rows[1]["tokens_per_step_by_set"]["code"], rows[2]["tokens_per_step_by_set"]["code"]
    assert usage >= strict  # the usage budget can only accept more
    table = bench.set_table(rows, old)
    assert "K=2 usage" in table and "K=2 " in table


def test_deterministic_reaches_every_arm(monkeypatch):
    """--deterministic: every arm's StartArgs asks for the batch-invariant kernels (CUDA only: on CPU the
    engine refuses them at start-up, so the arms are stubbed here)."""
    seen = []

    def arm(draft, name, args, prompts, groups, max_new_tokens):
        seen.append((name, args.enable_deterministic_inference))
        return {"draft": draft, "arm": name, "output_tokens_per_s": 1.0, "token_ids": [[1]] * len(prompts)}

    monkeypatch.setattr(bench, "run_arm", arm)
    for deterministic in (False, True):
        seen.clear()
        bench.measure(None, [[1, 2]], ["code"], ["default"], [3], "dspark", 4, asd_usage=True,
                      deterministic=deterministic)
        assert seen == [(n, deterministic) for n in ("no_mtp", "dspark_k3", "dspark_k3_asd_usage")]
