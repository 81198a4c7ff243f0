"""Fixtures for real services beyond the registry (loaded by tests/conftest.py).

- `containerd`: Debian's containerd as root, with its own root, state and socket in a
  temporary directory (see tests.services.start_containerd); `.ctr(...)` runs ctr in the
  `shoal-test` namespace. Stopped by PID on teardown, mounts under it undone, its
  directories removed. Tests using it carry the `containerd` marker.
- `node_and_containerd`: `shoal node` and a containerd using it as its proxy
  snapshotter (tests.services.shoal_node_with_containerd): (node, containerd).
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.services import (
    CONTAINERD_BIN,
    CTR_BIN,
    ContainerdServer,
    shoal_node_with_containerd,
    start_containerd,
)

RUNC_BIN = "/usr/sbin/runc"


def containerd_missing() -> str | None:
    """Why containerd tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "containerd tests need root"
    for path, package in ((CONTAINERD_BIN, "containerd"), (CTR_BIN, "containerd"), (RUNC_BIN, "runc")):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed (Debian package {package})"
    return None


def pytest_collection_modifyitems(items) -> None:
    """Tests that start containerd carry the `containerd` marker (`-m "not containerd"`)."""
    for item in items:
        if {"containerd", "node_and_containerd"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.containerd)


@pytest.fixture
def containerd(tmp_path_factory) -> ContainerdServer:
    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("containerd")
    server = start_containerd(workdir)
    try:
        yield server
    finally:
        try:
            server.stop()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def node_and_containerd():
    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    with shoal_node_with_containerd("shoal-node-") as pair:
        yield pair
