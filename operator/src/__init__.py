"""disagg.operator: the kopf operator (CRD spec models, manifests, reconcile, autoscaling).

The sources live one folder down (operator/src/, mapped in pyproject.toml), so the top-level `operator/` folder
has no __init__.py: with a checkout's root on sys.path it is at most a namespace portion, and a namespace portion
loses to the standard library's operator.py - `import operator` always means the standard library.
"""
