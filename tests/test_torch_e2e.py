"""The issue's end-to-end case: a real training image (Debian bookworm + torch 2.13.0 CPU +
numpy, about 1.1 GB), converted, pushed to Debian's registry, `shoal pull` into Debian's
containerd, `ctr run --snapshotter shoal` imports torch. The image is built once and cached
(tests/torchimage.py: about 3 minutes cold)."""

from __future__ import annotations

import json
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


def test_import_torch_from_a_lazy_image(torch_in_registry):
    registry, ref, manifest = torch_in_registry
    with shoal_node_with_containerd("shoal-torch-") as (_node, ctd):

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
        mark = fetched()
        out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", ref, "torch-2", *torchimage.CMD, timeout=600).stdout
        assert out.strip() == torchimage.EXPECTED
        assert fetched() == mark  # the second container fetches nothing
