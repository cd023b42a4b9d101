"""Loaded by every Python process the cluster-in-one-box kubelet starts (PYTHONPATH): the pod's network identity.

Pods here share the host's network namespace, each with its own loopback address 127.0.0.N. A real pod binding
0.0.0.0 listens on its own interfaces only; here that would take the port on every address and collide with the
next pod. So a wildcard IPv4 bind becomes a bind to the pod's own IP (CLUSTER_IN_A_BOX_POD_IP), which is what a
client of the pod sees in a cluster: the program's command line stays exactly as the operator built it.
"""
import os
import socket

_POD_IP = os.environ.get("CLUSTER_IN_A_BOX_POD_IP")

if _POD_IP:
    _bind = socket.socket.bind

    def _pod_bind(self, address):
        if self.family == socket.AF_INET and isinstance(address, tuple) and address[0] in ("", "0.0.0.0"):
            address = (_POD_IP, *address[1:])
        return _bind(self, address)

    socket.socket.bind = _pod_bind
