"""gpu_ci_summary: JUnit XML -> one-line summary + failed test names (hand-written XML)."""
import os
import subprocess
import sys

from conftest import FAILED_LIVE_ENV
from unit_tests.data_paths import REPO_ROOT
from unit_tests.gpu_ci_summary import main, parse_junit

# What pytest --junitxml writes, trimmed: one case per outcome, two suites
JUNIT_XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests">
  <testsuite name="pytest" errors="2" failures="1" skipped="2" tests="7" time="12.5">
    <testcase classname="unit_tests.test_a" name="test_ok" time="0.1" />
    <testcase classname="unit_tests.test_a.TestK" name="test_method[bf16-8]" time="0.1" />
    <testcase classname="unit_tests.test_a" name="test_fail" time="0.2"><failure message="assert 0">E assert 0</failure></testcase>
    <testcase classname="unit_tests.test_a" name="test_cuda_only" time="0.0"><skipped type="pytest.skip" message="needs CUDA" /></testcase>
    <testcase classname="unit_tests.test_a" name="test_xfail" time="0.0"><skipped type="pytest.xfail" message="" /></testcase>
    <testcase classname="unit_tests.test_a" name="test_teardown" time="0.0"><error message="failed on teardown">E RuntimeError</error></testcase>
    <testcase classname="unit_tests.test_a" name="test_both" time="0.0"><failure message="x" /><error message="y" /></testcase>
  </testsuite>
  <testsuite name="collect" errors="1" failures="0" skipped="0" tests="1" time="0.5">
    <testcase classname="" name="unit_tests.test_broken" time="0.0"><error message="collection failure" /></testcase>
  </testsuite>
</testsuites>
"""


def test_counts_names_and_line(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT_XML)
    s = parse_junit(str(path))
    assert (s.passed, s.failed, s.skipped, s.errors, s.total) == (2, 2, 2, 2, 8)
    assert s.line() == "passed=2 failed=2 skipped=2 errors=2 total=8 time=13.0s"
    assert s.failed_names == [
        "FAILED unit_tests.test_a::test_fail",
        "ERROR unit_tests.test_a::test_teardown",
        "FAILED unit_tests.test_a::test_both",
        "ERROR unit_tests.test_broken",
    ]


def test_single_testsuite_root_and_all_passed(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text('<testsuite name="pytest" time="1"><testcase classname="m" name="t" /></testsuite>')
    s = parse_junit(str(path))
    assert s.line() == "passed=1 failed=0 skipped=0 errors=0 total=1 time=1.0s" and s.failed_names == []


def test_cli_writes_summary_and_failed_files(tmp_path, capsys):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT_XML)
    summary, failed = tmp_path / "summary.txt", tmp_path / "failed.txt"
    assert main([str(path), "--summary", str(summary), "--failed", str(failed)]) == 0
    assert summary.read_text() == "passed=2 failed=2 skipped=2 errors=2 total=8 time=13.0s\n"
    assert failed.read_text().splitlines()[0] == "FAILED unit_tests.test_a::test_fail"
    assert capsys.readouterr().out.splitlines()[0] == summary.read_text().strip()


LIVE_TESTS = """
def test_passes():
    pass


def test_fails():
    assert 1 == 2
"""


def test_failures_are_named_as_they_happen(tmp_path):
    """The root conftest's hook writes a failing test's id while the run goes on (a run cut by a
    time limit still names them); a passing test leaves no line."""
    (tmp_path / "test_live.py").write_text(LIVE_TESTS)
    live = tmp_path / "failed_live.txt"
    env = dict(os.environ, **{FAILED_LIVE_ENV: str(live)})
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_live.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert live.read_text().splitlines() == ["call test_live.py::test_fails"]
