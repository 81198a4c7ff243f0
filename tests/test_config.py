"""Configuration is checked at start (shoal/config.py): a bad value stops `shoal node`
and `shoal region` with one line naming the key, the value and what is allowed, exit 2,
no traceback, nothing written; an unknown key is a warning naming it."""

from __future__ import annotations

import logging
import subprocess

import pytest

from shoal.config import ConfigError
from tests.services import SHOAL

NODE_CASES = [
    ("[fetch]\nstore_capacity = -1\n", "fetch.store_capacity = -1: must be at least 0"),
    ('[fetch]\nregion_url = "not a url"\n', "fetch.region_url = 'not a url': want http://"),
    ("[fetch]\nmemory_cache = -1\n", "fetch.memory_cache = -1"),
    ("[fetch]\nreadahead_kb = -1\n", "fetch.readahead_kb = -1: must be between 0 and 1048576"),
    ('[fetch]\nstore_capacity = "lots"\n', "fetch.store_capacity = 'lots': must be a size"),
    ("[fetch]\nprefetch_profiles = 1\n", "fetch.prefetch_profiles = 1: must be true or false"),
    ("[snapshotter]\nshutdown_grace = -1\n", "snapshotter.shutdown_grace = -1.0"),
    ("[snapshotter]\ngrpc_threads = 0\n", "snapshotter.grpc_threads = 0: must be between 1 and 1024"),
    ("[snapshotter]\ngrpc_threads = 'four'\n", "snapshotter.grpc_threads = 'four': must be a whole number"),
    ('[metrics]\naddress = "localhost"\n', "metrics.address = 'localhost': want HOST:PORT"),
    ('[metrics]\naddress = "127.0.0.1:99999"\n', "port 99999 is more than 65535"),
    ("[swarm]\nenabled = true\nstorage_capacity = -1\n", "swarm.storage_capacity = -1: must be at least 0"),
    ('[swarm]\nenabled = true\nconnections_limit = "500"\n', "swarm.connections_limit = '500': must be a whole"),
    ('[swarm]\nenabled = true\npeer_wait = "abc"\n', "swarm.peer_wait = 'abc': must be a number"),
    ('[cri]\nimage_service_socket = "cri.sock"\n', "cri.image_service_socket = 'cri.sock': must be an absolute"),
    (f'[cri]\nimage_service_socket = "/{"x" * 120}"\n', "longer than a unix socket path allows"),
    ("[cri]\ncredential_ttl = 0\n", "cri.credential_ttl = 0.0: must be between 60"),
    ("[snapshotter\n", "not valid TOML"),
    ('[node]\nname = "gpu[1-2]"\n', "node.name = 'gpu[1-2]': want letters, digits"),
    ("[node]\nname = 7\n", "node.name = 7: must be a string"),
]

REGION_CASES = [
    ("origin_timeout = -1\n", "origin_timeout = -1.0: must be between 0.1 and 3600"),
    ("[auth]\nttl = -1\n", "auth.ttl = -1.0: must be between 0 and 86400"),
    ('backend = "nfs"\n', "backend = 'nfs': must be one of 'disk', 's3'"),
    ('[disk]\ncapacity = "5Q"\n', "disk.capacity = '5Q': must be a size"),
    ("io_threads = 0\n", "io_threads = 0: must be between 1 and 1024"),
    ('block_size = "1K"\n', "block_size = 1024: must be between 4096"),
    ("[prefetch]\nnode_timeout = 0\n", "prefetch.node_timeout = 0.0: must be between 1 and 3600"),
    ("[prefetch]\ntoken_file = 3\n", "prefetch.token_file = 3: must be a string"),
]


def _one_line(argv: list[str], want: str) -> None:
    proc = subprocess.run([SHOAL, *argv], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, (argv, proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and want in lines[0], proc.stderr


@pytest.mark.parametrize("text,want", NODE_CASES, ids=[w.split(" ")[0] for _, w in NODE_CASES])
def test_bad_node_configuration_stops_the_start_in_one_line(text, want, tmp_path):
    config = tmp_path / "node config.toml"
    config.write_text(text)
    root = tmp_path / "root"
    _one_line(["node", "--root", str(root), "--socket", str(tmp_path / "s.sock"), "--config", str(config)], want)
    assert not root.exists() and not (tmp_path / "s.sock").exists()  # nothing written


@pytest.mark.parametrize("text,want", REGION_CASES, ids=[w.split(" ")[0] for _, w in REGION_CASES])
def test_bad_region_configuration_stops_the_start_in_one_line(text, want, tmp_path):
    config = tmp_path / "region config.toml"
    config.write_text(text)
    store = tmp_path / "store"
    _one_line(["region", "--origin", "http://127.0.0.1:1", "--store", str(store), "--config", str(config)], want)
    assert not store.exists()


def test_bad_region_flags_stop_the_start_in_one_line(tmp_path):
    store = str(tmp_path / "store")
    _one_line(["region", "--origin", "http://127.0.0.1:1", "--store", store, "--listen", "127.0.0.1:99999"],
              "listen = '127.0.0.1:99999': port 99999 is more than 65535")
    _one_line(["region", "--origin", "ftp://x", "--store", store], "origin = 'ftp://x': want http://")
    _one_line(["region", "--store", store], "an origin registry is required")


def test_unknown_keys_are_warnings_naming_the_key(tmp_path, caplog):
    from cache.region.config import load_config as load_region
    from snapshotter.node import load_config as load_node

    caplog.set_level(logging.WARNING)
    node = tmp_path / "node.toml"
    node.write_text("[fetch]\nstore_capacty = 5\nmemory_cache = '1G'\n[extra]\nx = 1\n")
    assert load_node(node).fetch.memory_cache == 1 << 30
    region = tmp_path / "region.toml"
    region.write_text("[disk]\ncapacty = 5\n")
    assert load_region(str(region), origin="http://127.0.0.1:1").disk.capacity is None
    text = caplog.text
    assert "fetch.store_capacty ignored" in text and "unknown configuration key extra" in text
    assert "disk.capacty ignored" in text


def test_config_values_are_typed():
    from shoal.config import parse_size

    assert [parse_size(v) for v in ("4096", "1K", "1.5M", "2GiB", 7)] == [4096, 1024, 1572864, 2 << 30, 7]
    for bad in ("", "1Q", "inf", True, None, "1e400T"):
        with pytest.raises((ValueError, OverflowError)):
            parse_size(bad)
    with pytest.raises(ConfigError):
        from p2p.config import SwarmConfig

        SwarmConfig.from_dict({"fallback_extent": 1})
