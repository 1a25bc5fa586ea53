"""Summarize a pytest JUnit XML: one line of counts, plus the names of failed / errored tests.

    python unit_tests/gpu_ci_summary.py junit.xml [--summary PATH] [--failed PATH]

Prints the summary line, then one ``FAILED <name>`` / ``ERROR <name>`` line per bad test.
Each testcase counts once: failed beats errored (a setup / teardown error) beats skipped
(xfail included) beats passed, so a test that passed and then errored in teardown is an error.
"""
import argparse
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import List

# JUnit child elements that mark a testcase's outcome; none of them means passed
FAILURE, ERROR, SKIPPED = "failure", "error", "skipped"


@dataclass
class JUnitSummary:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    time_s: float = 0.0
    failed_names: List[str] = field(default_factory=list)  # failures and errors, in file order

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.skipped + self.errors

    def line(self) -> str:
        return (f"passed={self.passed} failed={self.failed} skipped={self.skipped} errors={self.errors} "
                f"total={self.total} time={self.time_s:.1f}s")


def test_name(case: ET.Element) -> str:
    """``classname::name`` as pytest records them, e.g. ``unit_tests.a.test_b.TestK::test_c``."""
    classname, name = case.get("classname", ""), case.get("name", "")
    return f"{classname}::{name}" if classname else name


def parse_junit(path: str) -> JUnitSummary:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    s = JUnitSummary()
    for suite in suites:
        s.time_s += float(suite.get("time", 0) or 0)
        for case in suite.iter("testcase"):
            tags = {child.tag for child in case}
            if FAILURE in tags:
                s.failed += 1
                s.failed_names.append("FAILED " + test_name(case))
            elif ERROR in tags:
                s.errors += 1
                s.failed_names.append("ERROR " + test_name(case))
            elif SKIPPED in tags:
                s.skipped += 1
            else:
                s.passed += 1
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("junit_xml")
    p.add_argument("--summary", help="also write the one-line summary here")
    p.add_argument("--failed", help="also write the failed / errored test names here, one per line")
    args = p.parse_args(argv)
    s = parse_junit(args.junit_xml)
    print(s.line())
    for name in s.failed_names:
        print(name)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(s.line() + "\n")
    if args.failed:
        with open(args.failed, "w") as f:
            f.write("".join(n + "\n" for n in s.failed_names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
