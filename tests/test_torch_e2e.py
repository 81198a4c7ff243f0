"""The issue's end-to-end case: a real training image (Debian bookworm + torch 2.13.0 CPU +
numpy, about 1.1 GB), converted, pushed to Debian's registry, `shoal pull` into Debian's
containerd, `ctr run --snapshotter shoal` imports torch. The image is built once and cached
(tests/torchimage.py: about 3 minutes cold)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder.oci.refs import open_source
from tests import torchimage
from tests.fixtures_services import containerd_missing
from tests.services import SHOAL, shoal_node_with_containerd, start_registry

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.registry, pytest.mark.containerd, pytest.mark.slow]


@pytest.fixture(scope="module")
def torch_in_registry(tmp_path_factory):
    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    converted = torchimage.torch_image_converted()
    registry = start_registry(tmp_path_factory.mktemp("registry"), None)
    try:
        ref = torchimage.push(converted, "torch", registry.host, dest_tag="lazy")
        with open_source(f"docker://{ref}", plain_http=True) as s:
            manifest = json.loads(s.get_root().data)
        yield registry, ref, manifest
    finally:
        registry.stop()


def drop_page_cache(root: Path) -> int:
    """posix_fadvise(DONTNEED) on every regular file under `root`: the kernel drops their
    cached pages. Returns how many files."""
    n = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            n += 1
    return n


def test_import_torch_from_a_lazy_image(torch_in_registry):
    registry, ref, manifest = torch_in_registry
    # The lazy layers' background proof reads their whole blobs 30 s after the Prepare
    # (`[fetch] prove_after`); under the full suite's load this test outlasted that, and
    # the proof's first bytes were counted against the second container. Proofs are
    # tested in tests/test_chain_poisoning.py; here they wait.
    with shoal_node_with_containerd("shoal-torch-", "[fetch]\nprove_after = 3600\n") as (_node, ctd):

        def fetched() -> int:
            return sum(registry.count("GET", ly["digest"])[1] for ly in manifest["layers"])

        start = fetched()
        pull = subprocess.run([SHOAL, "pull", ref, "--address", ctd.address, "--namespace", "shoal-test", "--json"],
                              capture_output=True, text=True, check=False)
        assert pull.returncode == 0, pull.stderr
        assert [ly["kind"] for ly in json.loads(pull.stdout)["layers"]] == ["lazy", "lazy"]
        out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", ref, "torch-1", *torchimage.CMD, timeout=600).stdout
        assert out.strip() == torchimage.EXPECTED
        used = fetched() - start
        image_bytes = sum(ly["size"] for ly in manifest["layers"])
        print(f"\nfetched {used:,} of {image_bytes:,} bytes ({used / image_bytes:.1%}) to import torch",
              file=sys.stderr)
        assert 0 < used < 0.5 * image_bytes
        # The kernel lets go of the layers' pages (as under memory pressure): the second
        # container's reads come back to the layer file systems, which have let go of the
        # chunks the kernel held (cache/memory.py) and read them from the node's store.
        dropped = drop_page_cache(_node.root / "mnt")
        assert dropped > 1000, dropped
        mark = fetched()
        out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", ref, "torch-2", *torchimage.CMD, timeout=600).stdout
        assert out.strip() == torchimage.EXPECTED
        assert fetched() == mark  # the second container fetches nothing
