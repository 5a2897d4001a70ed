"""A free TCP port on this machine, for a process we are about to start to listen on.

Its users are the local backend (the coordinator of a multi-host attempt), the sandbox's pods (one
coordinator per pod set) and the GCS emulator's helper: `backends/` and `sandbox/`. It sits beside
`storage` in the layers (tests/test_layers.py), the lowest one that may do I/O (`core` is pure), so
that any layer may import it, the trainer included.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the OS picks it); the caller's process binds it soon after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
