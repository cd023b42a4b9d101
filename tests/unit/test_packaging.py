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


def test_the_operator_folder_is_no_package_and_needs_no_exec_trick():
    # the checkout's root first on sys.path, as `python -m ...` from it: the top-level operator/ folder (no
    # __init__.py) is at most a namespace portion, which loses to the standard library's operator.py
    assert not (ROOT / "operator" / "__init__.py").exists()
    # -S: nothing has imported the stdlib operator yet; site.main() then adds the installed (editable) package
    code = ("import sys; sys.path.insert(0, sys.argv[1]); assert 'operator' not in sys.modules; import operator; "
            "assert operator.itemgetter is __import__('_operator').itemgetter, operator.__file__; "
            "assert operator.__file__.endswith('operator.py') and sys.argv[1] not in operator.__file__; "
            "import site; site.main(); import disagg.operator.spec; print(disagg.operator.spec.__name__)")
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "disagg.operator.spec", proc.stderr
    assert "exec(" not in (ROOT / "operator" / "src" / "__init__.py").read_text()
