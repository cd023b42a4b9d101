"""The CPUs the tests may load (disagg.worker.cores): a case sized for 4 cores must see the cores a container
really has - affinity cut to its cgroup's CPU quota - or it runs starved on 2 instead of skipping."""
from disagg.worker.cores import cgroup_cpu_quota, usable_cores  # noqa: F401
