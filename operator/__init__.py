"""disagg.operator: the kopf operator (CRD spec models, manifests, reconcile, autoscaling).

Installed as `disagg.operator`. The folder is named by the design card, so whenever a checkout's root
is on sys.path (`python -m ...` or `python -c ...` run from it, before the standard library's
`operator` is loaded) `import operator` finds this file under the top-level name. In that case it
becomes the standard library module, so `import operator` always means the standard library.
"""
if __name__ == "operator":
    import os as _os

    _stdlib_operator = _os.path.join(_os.path.dirname(_os.__file__), "operator.py")
    with open(_stdlib_operator, encoding="utf-8") as _source:
        exec(compile(_source.read(), _stdlib_operator, "exec"))  # noqa: S102 - the stdlib's own file
    del _os, _source, _stdlib_operator
