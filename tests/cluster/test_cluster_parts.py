"""The cluster in one box holds to the Kubernetes rules the scenarios rely on: checked with small shell pods (fast),
and the pure parts table-driven."""
from __future__ import annotations

import base64
import time
import uuid

import pytest

from deployments import removal_order, rollout_step
from pod_env import ContainerConfigError, container_argv, container_env, expand
from waiting import wait_for


# ---------------------------------------------------------------- pure parts
@pytest.mark.parametrize("text, expected", [
    ("$(A)-$(B)", "1-$(B)"),  # undefined stays as written
    ("$$(A)", "$(A)"),  # $$ escapes
    ("x$(A)y", "x1y"),
    ("$A", "$A"),  # only $(...) is a reference
])
def test_variable_expansion_follows_kubernetes(text, expected):
    assert expand(text, {"A": "1"}) == expected


def test_env_order_downward_api_secrets_and_envfrom():
    pod = {"metadata": {"name": "p", "namespace": "ns", "labels": {"app": "x"}}, "status": {"podIP": "127.9.9.9"}}
    sources = {("Secret", "s"): {"TOKEN": "t0p", "USER": "u"}, ("ConfigMap", "c"): {"MODE": "fast"}}
    container = {
        "envFrom": [{"secretRef": {"name": "s"}, "prefix": "S_"}, {"configMapRef": {"name": "c"}}],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "ADDR", "value": "$(POD_IP):8000"},
                {"name": "LATER", "value": "$(NEXT)"},  # defined after: not expanded
                {"name": "NEXT", "value": "n"},
                {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "TOKEN"}}},
                {"name": "GONE", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}}],
        "command": ["run"], "args": ["--host", "$(POD_IP)", "--mode=$(MODE)"]}
    env = container_env(pod, container, lambda kind, name: sources.get((kind, name)))
    assert env == {"S_TOKEN": "t0p", "S_USER": "u", "MODE": "fast", "POD_IP": "127.9.9.9",
                   "ADDR": "127.9.9.9:8000", "LATER": "$(NEXT)", "NEXT": "n", "APP": "x", "TOKEN": "t0p"}
    assert container_argv(container, env, ["entry"]) == ["run", "--host", "127.9.9.9", "--mode=fast"]
    with pytest.raises(ContainerConfigError, match='secret "nope" not found'):
        container_env(pod, {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}}]},
                      lambda kind, name: None)


def _pod(name, ready=True, cost=None, created="2026-01-01T00:00:00Z", phase="Running", digest="h"):
    return {"metadata": {"name": name, "creationTimestamp": created, "labels": {"pod-template-hash": digest},
                         "annotations": {} if cost is None else {"controller.kubernetes.io/pod-deletion-cost": cost}},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_scale_down_order_pending_then_not_ready_then_lowest_cost_then_newest():
    pods = [_pod("old"), _pod("new", created="2026-01-02T00:00:00Z"), _pod("cheap", cost="-1000"),
            _pod("unready", ready=False), _pod("pending", ready=False, phase="Pending"), _pod("dear", cost="5")]
    assert [p["metadata"]["name"] for p in removal_order(pods)] == ["pending", "unready", "cheap", "new", "old",
                                                                    "dear"]


def test_rolling_update_surges_then_removes_old_pods_as_new_ones_become_ready():
    old = [_pod("o1", digest="a"), _pod("o2", digest="a")]
    # 2 replicas, 25%: surge 1 (rounded up), unavailable 0 (rounded down)
    assert rollout_step(2, [], old, {}) == (1, [])
    create, delete = rollout_step(2, [_pod("n1", ready=False, digest="b")], old, {})
    assert (create, delete) == (0, [])  # no room to surge more, nothing may become unavailable
    create, delete = rollout_step(2, [_pod("n1", digest="b")], old, {})
    assert create == 0 and [p["metadata"]["name"] for p in delete] == ["o2"]  # same age: last name first
    assert rollout_step(2, [_pod("n1", digest="b")], old[:1], {}) == (1, [])


# ---------------------------------------------------------------- the kubelet and the API server, with shell pods
def _shell_pod(name: str, script: str, **spec):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", script],
                                     "env": [{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                                             {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "parts",
                                                                                               "key": "word"}}}],
                                     "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                                     "securityContext": {"readOnlyRootFilesystem": True}}],
                     "volumes": [{"name": "data", "emptyDir": {}}], **spec}}


def _log(cluster, pod: str, container: str = "main") -> str:
    path = cluster.log_dir / f"default_{pod}_{container}.log"
    return path.read_text() if path.exists() else ""


@pytest.fixture(scope="module")
def secret(cluster):
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "parts"},
                   "data": {"word": base64.b64encode(b"swordfish").decode()}})


def test_init_containers_run_in_order_then_the_container_with_its_env_volumes_and_readonly_root(cluster, secret):
    pod = _shell_pod("parts-init", 'cat /data/order; echo "ip=$IP secret=$SECRET"; touch /root/x 2>&1; sleep 60',
                     terminationGracePeriodSeconds=5,
                     initContainers=[{"name": f"init{i}", "image": "busybox", "command": ["sh", "-c",
                                                                                         f"echo {i} >> /data/order"],
                                      "volumeMounts": [{"name": "data", "mountPath": "/data"}]} for i in (1, 2)])
    cluster.apply(pod)
    text = wait_for(lambda: "secret=" in (t := _log(cluster, "parts-init")) and "Read-only" in t and t, 30,
                    "the main container's output")
    ip = cluster.store.get_object("", "v1", "pods", "default", "parts-init")["status"]["podIP"]
    assert f"1\n2\nip={ip} secret=swordfish" in text, text
    cluster.kubectl("delete", "pod", "parts-init", "--wait=false")
    wait_for(lambda: cluster.store.get_object("", "v1", "pods", "default", "parts-init") is None, 15, "pod gone")


def test_a_failing_init_container_keeps_the_pod_from_starting(cluster, secret):
    pod = _shell_pod("parts-badinit", "echo main ran; sleep 60", terminationGracePeriodSeconds=2,
                     initContainers=[{"name": "fails", "image": "busybox", "command": ["sh", "-c", "exit 3"]}])
    cluster.apply(pod)
    status = wait_for(lambda: (p := cluster.store.get_object("", "v1", "pods", "default", "parts-badinit"))
                      and (p.get("status") or {}).get("initContainerStatuses", [{}])[0].get("restartCount", 0) >= 1
                      and p["status"], 30, "the init container to fail")
    assert status["phase"] == "Pending" and status["initContainerStatuses"][0]["lastState"]["terminated"][
        "exitCode"] == 3, status
    assert "main ran" not in _log(cluster, "parts-badinit")
    cluster.kubectl("delete", "pod", "parts-badinit", "--wait=false")
    wait_for(lambda: cluster.store.get_object("", "v1", "pods", "default", "parts-badinit") is None, 15, "pod gone")


@pytest.mark.slow  # real processes on a busy machine: one more try (two CI runs lost the hook's output once)
def test_deletion_runs_prestop_then_sigterm_and_sigkills_at_the_end_of_the_grace_period(cluster, secret):
    script = 'trap "echo got TERM" TERM; echo started; while true; do sleep 0.1; done'
    name = f"parts-grace-{uuid.uuid4().hex[:6]}"  # a rerun's pod is not the last try's, which may still terminate
    pod = _shell_pod(name, script, terminationGracePeriodSeconds=6)
    pod["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {"command": ["sh", "-c", "echo prestop"]}}}
    cluster.apply(pod)
    wait_for(lambda: "started" in _log(cluster, name), 30, "the container to start")
    t0 = time.monotonic()
    cluster.kubectl("delete", "pod", name, "--wait=false")
    terminating = cluster.store.get_object("", "v1", "pods", "default", name)
    assert terminating["metadata"]["deletionGracePeriodSeconds"] == 6  # marked, not removed
    wait_for(lambda: cluster.store.get_object("", "v1", "pods", "default", name) is None, 17, "pod gone")
    elapsed = time.monotonic() - t0
    log = wait_for(lambda: "\nprestop\n" in (t := _log(cluster, name)) and "\ngot TERM\n" in t and t, 5,
                   "the hook's and the trap's output")
    assert log.index("\nprestop\n") < log.index("\ngot TERM\n"), log  # the hook, then SIGTERM (ignored), then SIGKILL
    assert 5.5 < elapsed < 17, elapsed  # the whole grace period: SIGTERM did not end it, SIGKILL did


def test_deleting_an_owner_collects_its_dependents(cluster):
    with cluster.api.client() as http:
        owner = http.post("/api/v1/namespaces/default/configmaps", json={"metadata": {"name": "gc-owner"}}).json()
        ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "gc-owner", "uid": owner["metadata"]["uid"]}
        http.post("/api/v1/namespaces/default/configmaps",
                  json={"metadata": {"name": "gc-child", "ownerReferences": [ref]}}).raise_for_status()
        http.delete("/api/v1/namespaces/default/configmaps/gc-owner").raise_for_status()
    assert cluster.store.get_object("", "v1", "configmaps", "default", "gc-child") is None


def test_an_exited_container_is_restarted_with_its_restart_count(cluster, secret):
    cluster.apply(_shell_pod("parts-crash", "echo run; exit 1", terminationGracePeriodSeconds=2))
    status = wait_for(lambda: (p := cluster.store.get_object("", "v1", "pods", "default", "parts-crash"))
                      and (p.get("status") or {}).get("containerStatuses", [{}])[0].get("restartCount", 0) >= 2
                      and p["status"], 30, "two restarts")
    assert status["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 1, status
    assert _log(cluster, "parts-crash").count("\nrun\n") >= 2
    cluster.kubectl("delete", "pod", "parts-crash", "--wait=false")
    wait_for(lambda: cluster.store.get_object("", "v1", "pods", "default", "parts-crash") is None, 15, "pod gone")


def test_127_0_0_1_is_each_pods_own_shared_by_its_containers(cluster):
    """Two pods serve on 127.0.0.1 at the same port (vLLM's place behind pd-proxy): no collision, and each pod's
    other container reaches its own pod's server there."""
    import sys

    client = ("import time, urllib.request\n"
              "while True:\n"
              "    try: print('got', urllib.request.urlopen('http://127.0.0.1:18080/who', timeout=2).read().decode(),"
              " flush=True)\n"
              "    except OSError as e: print('error', e, flush=True)\n"
              "    time.sleep(0.3)\n")
    for name in ("parts-lo-a", "parts-lo-b"):
        cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
                       "spec": {"terminationGracePeriodSeconds": 2, "volumes": [{"name": "data", "emptyDir": {}}],
                                "containers": [
                                    {"name": "server", "image": "python", "command": ["sh", "-c",
                                     f"echo {name} > /data/who && exec {sys.executable} -m http.server 18080 "
                                     "--bind 127.0.0.1 --directory /data"],
                                     "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
                                    {"name": "client", "image": "python", "command": [sys.executable, "-c", client]}]}})
    for name in ("parts-lo-a", "parts-lo-b"):
        wait_for(lambda name=name: f"got {name}" in _log(cluster, name, "client"), 30, f"{name}'s own server")
        assert "got parts-lo-" + ("b" if name.endswith("a") else "a") not in _log(cluster, name, "client")
        cluster.kubectl("delete", "pod", name, "--wait=false")
    for name in ("parts-lo-a", "parts-lo-b"):
        wait_for(lambda name=name: cluster.store.get_object("", "v1", "pods", "default", name) is None, 15,
                 "pod gone")
