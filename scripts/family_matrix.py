#!/usr/bin/env python3
"""Run the family matrix (tests/test_hf_backend.py::test_family_matches_transformers_in_every_mode)
and write its results into docs/inference.md between the family-matrix markers: every family of the
installed transformers, whether it passed in every mode, or why it was skipped or failed.

    .venv/bin/python scripts/family_matrix.py          # runs the matrix (a few minutes)
    .venv/bin/python scripts/family_matrix.py --check  # exit 1 if docs/inference.md is out of date
                                                       # with the installed transformers' families
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LISTING = ROOT / "docs" / "inference.md"
BEGIN, END = "<!-- family-matrix:begin -->", "<!-- family-matrix:end -->"
TEST = "tests/test_hf_backend.py::test_family_matches_transformers_in_every_mode"


class Outcomes:
    """A pytest plugin that keeps each family's outcome."""

    def __init__(self) -> None:
        self.by_family: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        m = re.search(r"\[(.+)\]$", report.nodeid)
        if m is None or "test_family_matches" not in report.nodeid:
            return
        family = m.group(1)
        if report.when == "call" and report.passed:
            refused = dict(report.user_properties).get("refused") or []
            self.by_family[family] = ("passes in every mode" if not refused else
                                      "passes in every other mode; " + "; ".join(refused))
        elif report.failed:
            self.by_family[family] = "FAILS"
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else "skipped"
            self.by_family[family] = f"skipped: {reason.removeprefix('Skipped: ')}"


def block(by_family: dict[str, str], version: str) -> str:
    passed = [f for f, o in by_family.items() if o.startswith("passes")]
    lines = [BEGIN, f"transformers {version}: {len(passed)} of {len(by_family)} families pass.",
             "", "| family | outcome |", "|---|---|"]
    lines += [f"| `{f}` | {o} |" for f, o in sorted(by_family.items())]
    lines.append(END)
    return "\n".join(lines)


def listed(text: str) -> set[str]:
    inside = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \|", inside, re.M))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="Only check that docs/inference.md lists exactly the installed families.")
    args = p.parse_args()
    import transformers
    from tierstore.hf.families import causal_lm_families

    text = LISTING.read_text(encoding="utf-8")
    families = set(causal_lm_families())
    if args.check:
        have = listed(text)
        if have != families:
            print(f"docs/inference.md lists {len(have)} families, transformers {transformers.__version__} "
                  f"has {len(families)}: rerun scripts/family_matrix.py", file=sys.stderr)
            return 1
        return 0
    import pytest

    outcomes = Outcomes()
    pytest.main(["-q", "-p", "no:cacheprovider", str(ROOT / TEST.split("::")[0]),
                 "-k", "family_matches"], plugins=[outcomes])
    missing = families - set(outcomes.by_family)
    for f in missing:
        outcomes.by_family[f] = "not run"
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END),
                 block(outcomes.by_family, transformers.__version__), text, flags=re.S)
    LISTING.write_text(new, encoding="utf-8")
    print(f"docs/inference.md: {sum(o.startswith('passes') for o in outcomes.by_family.values())} of "
          f"{len(outcomes.by_family)} families pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
