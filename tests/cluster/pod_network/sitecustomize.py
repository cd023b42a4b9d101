"""Loaded by every Python process the cluster-in-one-box kubelet starts (PYTHONPATH): the pod's network identity.

Pods here share the host's network namespace, each with its own loopback address 127.0.0.N. A real pod binding
0.0.0.0 listens on its own interfaces only; here that would take the port on every address and collide with the
next pod. So a wildcard IPv4 bind becomes a bind to the pod's own IP (CLUSTER_IN_A_BOX_POD_IP), which is what a
client of the pod sees in a cluster: the program's command line stays exactly as the operator built it.

127.0.0.1 inside a pod is the pod's own: its containers reach each other there (vLLM behind `disagg pd-proxy`)
and nothing else does. Here a bind to 127.0.0.1 becomes a bind to the pod IP (two pods' 127.0.0.1:8001 would
collide otherwise), and the port is noted in the pod's loopback directory (CLUSTER_IN_A_BOX_LOOPBACK, shared by
the pod's containers only); a connect to 127.0.0.1 on a noted port goes to the pod IP. A connect to any other
127.0.0.1 port is left alone (the API server, test servers on the host).
"""
import os
import socket

_POD_IP = os.environ.get("CLUSTER_IN_A_BOX_POD_IP")
_LOOPBACK_DIR = os.environ.get("CLUSTER_IN_A_BOX_LOOPBACK")
_LOCALHOST = ("127.0.0.1", "localhost")

if _POD_IP:
    _bind = socket.socket.bind
    _connect = socket.socket.connect
    _connect_ex = socket.socket.connect_ex

    def _pod_bind(self, address):
        loopback = False
        if self.family == socket.AF_INET and isinstance(address, tuple):
            if address[0] in ("", "0.0.0.0"):
                address = (_POD_IP, *address[1:])
            elif address[0] in _LOCALHOST and _LOOPBACK_DIR:
                address, loopback = (_POD_IP, *address[1:]), True
        result = _bind(self, address)
        if loopback:
            open(os.path.join(_LOOPBACK_DIR, str(self.getsockname()[1])), "w").close()
        return result

    def _pod_address(self, address):
        if (_LOOPBACK_DIR and self.family == socket.AF_INET and isinstance(address, tuple)
                and address[0] in _LOCALHOST and os.path.exists(os.path.join(_LOOPBACK_DIR, str(address[1])))):
            return (_POD_IP, *address[1:])
        return address

    def _pod_connect(self, address):
        return _connect(self, _pod_address(self, address))

    def _pod_connect_ex(self, address):
        return _connect_ex(self, _pod_address(self, address))

    socket.socket.bind = _pod_bind
    socket.socket.connect = _pod_connect
    socket.socket.connect_ex = _pod_connect_ex
