"""`disagg operator`: run the kopf operator for DisaggregatedInference resources."""
from __future__ import annotations

import argparse
import asyncio
import logging

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs like 'team-*' allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (the default)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="INFO")
    parser.add_argument("--resync-seconds", type=float, default=10.0,
                        help="period of the level-based pass that also refreshes status from the children")
    ha = parser.add_mutually_exclusive_group()
    ha.add_argument("--standalone", action="store_true", default=True,
                    help="no peering: one operator replica (the default)")
    ha.add_argument("--peering", metavar="NAME",
                    help="HA: replicas coordinate through kopf's (Cluster)KopfPeering NAME; the highest "
                         "--priority is active, others stand by (needs kopf's peering CRDs)")
    parser.add_argument("--priority", type=int, default=0, help="peering priority of this replica")
    parser.add_argument("--liveness", metavar="URL", help="e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="serve the operator's Prometheus metrics (disagg_operator_desired_replicas, "
                             "disagg_operator_scaling_decisions_total) on 0.0.0.0:PORT/metrics; 0 = off (default)")


def run(args: argparse.Namespace) -> int:
    import kopf

    from prometheus_client import start_http_server

    from disagg.operator.autoscaling.cluster import OperatorMetrics
    from disagg.operator.handlers import build_registry

    # kopf installs the root log handler; ours (disagg.*) propagate to it
    kopf.configure(verbose=args.log_level == "DEBUG", quiet=args.log_level in ("WARNING", "ERROR"))
    logging.getLogger().setLevel(args.log_level)
    namespaces = list(args.namespace)
    metrics = OperatorMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr="0.0.0.0", registry=metrics.registry)  # a daemon thread
    asyncio.run(kopf.operator(
        registry=build_registry(args.resync_seconds),
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(metrics=metrics),
    ))
    return 0
