"""Loopback helpers for tests that start servers (Ray, the GCS emulator): never any other address."""

from __future__ import annotations

import socket


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
