"""`import operator` is the standard library's, also when a checkout's root is on sys.path."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stdlib_operator_wins_from_the_repository_root():
    # -S: no site, so nothing has imported the stdlib operator before cwd ('') is searched;
    # `python3 -m venv .venv` from a fresh checkout hits exactly this
    code = "import collections, operator; assert operator.itemgetter(1)([5, 6]) == 6; print(operator.eq(2, 2))"
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr


def test_the_package_is_disagg_operator():
    import operator

    import disagg.operator.spec

    assert operator.__name__ == "operator" and hasattr(operator, "attrgetter")
    assert disagg.operator.spec.__name__ == "disagg.operator.spec"
