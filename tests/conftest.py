"""Shared pytest fixtures for voltaforge's tests.

Real SSH test hosts (private sshd, sshd in a network namespace, Debian 12 booted with
systemd-nspawn) live in tests/testhosts.py; importing them here registers them as fixtures.
"""

from testhosts import (  # noqa: F401  (imported to register the fixtures)
    make_sshd_host,
    netns_host,
    nspawn_host,
    sshd_host,
    testhost_user,
)
