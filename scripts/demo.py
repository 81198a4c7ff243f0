"""The main job on embedded defaults: a local registry, a real image, `shoal convert`,
`shoal inspect --verify`. Everything runs on loopback and is cleaned up at the end.

Run with `make demo`. Later issues grow this into the full lazy-start demo.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.lab.fromdir import ImageConfig, build_image
from tests.rootfs import busybox_layer, delta_layer, python_layer
from tests.services import shoal_node_with_containerd, start_registry

SHOAL = str(Path(sys.executable).parent / "shoal")


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run(*args: str) -> None:
    print("$ " + " ".join(args), flush=True)
    subprocess.run(args, check=True)


def lazy_start(work: Path, registry, ref: str) -> None:
    """shoal node as containerd's proxy snapshotter; shoal pull; ctr run."""
    step("starting shoal node (containerd's proxy snapshotter) and containerd with it")
    with shoal_node_with_containerd("shoal-demo-") as (node, ctd):
        before = registry.count("GET", "/blobs/")[1]
        step("shoal pull: manifest and config into containerd, layers lazy")
        run(SHOAL, "pull", ref, "--address", ctd.address, "--namespace", "shoal-test")
        step("ctr run --snapshotter shoal: the container starts and reads only what it touches")
        cmd = ["/usr/bin/python3", "-c", "print('hello from a lazy image')"]
        print(ctd.ctr("run", "--rm", "--snapshotter", "shoal", ref, "demo", *cmd).stdout, end="")
        fetched = registry.count("GET", "/blobs/")[1] - before
        run(SHOAL, "status", "--root", str(node.root))
        print(f"\nbytes fetched from the registry for this start: {fetched:,}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="shoal-demo-") as tmp:
        work = Path(tmp)
        step("starting a local registry (Debian's docker-registry) on loopback")
        (work / "registry").mkdir()
        registry = start_registry(work / "registry", None)
        try:
            print(f"registry at {registry.url}")
            step("building a real image: busybox, Debian's python3.11 and its standard library")
            layers = [
                busybox_layer(work / "l1"),
                python_layer(work / "l2"),
                delta_layer(work / "l3"),
            ]
            src = f"docker://{registry.host}/demo/python:gzip"
            cfg = ImageConfig(cmd=["/usr/bin/python3", "-c", "print('hello from a lazy image')"])
            build_image([str(p) for p in layers], src, cfg, plain_http=True, workdir=tmp)
            print(f"pushed {src}")
            dst = f"docker://{registry.host}/demo/python:chunked"
            step("converting it to zstd:chunked")
            run(SHOAL, "convert", "--plain-http", src, dst)
            step("inspecting and verifying every digest of the converted image")
            run(SHOAL, "inspect", "--plain-http", "--verify", dst)
            step("converting again changes nothing (same digest)")
            run(SHOAL, "convert", "--plain-http", dst, f"docker://{registry.host}/demo/python:again")
            lazy_start(work, registry, dst.removeprefix("docker://"))
        finally:
            registry.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
