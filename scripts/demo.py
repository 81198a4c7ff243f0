"""The main job on embedded defaults: a local registry, a real image, `shoal convert`,
`shoal inspect --verify`. Everything runs on loopback and is cleaned up at the end.

Run with `make demo`. Later issues grow this into the full lazy-start demo.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from builder.oci.fromdir import ImageConfig, build_image  # noqa: E402
from tests.rootfs import busybox_layer, delta_layer, python_layer  # noqa: E402
from tests.services import start_registry  # noqa: E402

SHOAL = str(Path(sys.executable).parent / "shoal")


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run(*args: str) -> None:
    print("$ " + " ".join(args), flush=True)
    subprocess.run(args, check=True)


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
        finally:
            registry.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
