"""`disagg up --tls`: a self-signed certificate and key for a local try of TLS, made with the openssl command
(every machine that runs Python's ssl module has OpenSSL; the `cryptography` package is no dependency of ours).

The certificate is its own CA: a client trusts it by name (`curl --cacert cert.pem`, httpx's `verify=`), never
by being added to the system's trust store. It is valid for a week, for the addresses it is made for.
"""
from __future__ import annotations

import ipaddress
import shutil
import ssl
import subprocess
from pathlib import Path

VALID_DAYS = 7


def subject_alt_names(hosts: list[str]) -> str:
    """openssl's subjectAltName value: IP: for addresses, DNS: for names; localhost and 127.0.0.1 always."""
    names = []
    for host in dict.fromkeys([*hosts, "127.0.0.1", "localhost"]):
        try:
            names.append(f"IP:{ipaddress.ip_address(host)}")
        except ValueError:
            names.append(f"DNS:{host}")
    return ",".join(names)


def write_self_signed(directory: Path, hosts: list[str]) -> tuple[Path, Path]:
    """(cert.pem, key.pem) in `directory` (the key readable by its owner only); ValueError when openssl is
    missing or fails."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ValueError("--tls needs the openssl command to make a self-signed certificate; install OpenSSL, or "
                         "give the router your own pair (--tls-cert-file, --tls-key-file)")
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "tls-cert.pem", directory / "tls-key.pem"
    key.touch(mode=0o600)
    argv = [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-days", str(VALID_DAYS), "-subj", "/CN=disagg up (self-signed)", "-keyout", str(key), "-out", str(cert),
            "-addext", f"subjectAltName={subject_alt_names(hosts)}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=digitalSignature,keyCertSign"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"openssl could not make a self-signed certificate: {done.stderr.strip()[-300:]}")
    return cert, key


def client_context(ca_file: str | Path) -> ssl.SSLContext:
    """What a client verifies a server with, trusting only `ca_file`."""
    return ssl.create_default_context(cafile=str(ca_file))
