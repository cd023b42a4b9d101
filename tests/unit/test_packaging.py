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
    # a fresh interpreter in the repository root, as a user's shell: the package imports as disagg.operator and
    # `operator` stays the standard library's
    code = ("import disagg.operator.spec, operator; assert operator.__name__ == 'operator'; "
            "assert hasattr(operator, 'attrgetter'); print(disagg.operator.spec.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "disagg.operator.spec", proc.stderr
