"""Which names and addresses are loopback: the rule behind every "off on loopback, required elsewhere"
default (the gateway's API keys, its Host / Origin checks, the engine's gRPC token)."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """'localhost', '*.localhost', 127.0.0.0/8 or ::1 (brackets and a port allowed)."""
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
