"""benchmarks/profile_stage_rows.py runs on CPU and reports the rows it laid out."""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import profile_stage_rows  # noqa: E402


def test_reports_each_chunk_count(tmp_path):
    out = tmp_path / "stage.json"
    assert profile_stage_rows.main(["--running", "8", "--mtp_step", "2", "--chunks", "1,2", "--chunk_tokens", "10",
                                    "--repeats", "2", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    # 7 decode items of 3 rows + 1 chunk of 10; 6 x 3 + 2 x 10; padded to the ladder's powers of two
    assert [(r["prompt_chunks"], r["rows"], r["padded_rows"]) for r in results] == [(1, 31, 32), (2, 38, 64)]
    assert all(r["stage_us"] > 0 for r in results)
