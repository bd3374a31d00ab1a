"""Addresses: whether a host is loopback (every tidal service binds 127.0.0.1 unless told
otherwise, and needs a token anywhere else). Its own module, free of tidal's heavy imports,
so that servers, Ray placement and its workers share it without importing each other."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
