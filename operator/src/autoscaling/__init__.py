"""Autoscaling of the prefill and decode pools, shared by the operator and `disagg up`.

    sources.py (I/O: scrape /metrics, Prometheus API) -> samples.py (PodSample, metric names; pure)
        -> inputs.py (policy from spec.autoscaling, samples folded per role)
        -> classify.py (demand per role, which pool is the bottleneck) -> policy.py (decide: windows, limits)
    scaling_pass.py: scrape -> decide -> choose who leaves -> what to tell (report.py: changes, metrics, times)
    apply: cluster.py (Deployment replicas, pod-deletion-cost, status) | disagg.worker.local.scaling (processes)

A new scaling signal: its metric name in samples.py; its target in spec.py (ScalingTargets) and in inputs.py
(AutoscalePolicy, policy_from_spec); its per-role number in inputs.py (RoleMetrics, aggregate_role); its ratio and
reported value in classify.py; then, from the checkout's root,
`python -m disagg.operator.crd --out crds --out charts/disagg-operator/crds`.
"""
