"""Helpers shared by tests of several tiers (tests/conftest.py puts this folder on sys.path)."""
import socket


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a test's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
