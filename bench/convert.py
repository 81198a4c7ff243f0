"""Convert benchmark: `shoal convert` against the zstd and gzip CLIs on the same layer tar.

    .venv/bin/python bench/convert.py [--quick] [--json] [--keep-cache]

The tree is a real Python environment: the full run uses a venv with the torch CPU wheel
and numpy installed into it (about 1 GB; built once with the machine's `python3 -m venv`
and cached under $SHOAL_BENCH_CACHE or ~/.cache/shoal-bench); --quick uses the system's
Python standard library, the python3.11 binary and shoal's own .venv site-packages
(about 150 MB, nothing to install). The tree becomes a single-layer OCI image with an
uncompressed tar layer, and on that very tar (warmed into the page cache before each
timed run) the benchmark measures:

- shoal:        `shoal convert --json oci:SRC:src oci:OUT:dst` (a fresh OUT each time); the
                headline uses the whole command's wall time; the per-layer `seconds` of
                the JSON summary is shown as well;
- zstd -3 -T N: the throughput baseline (N = the number of CPUs, as shoal uses);
- zstd -3:      the size baseline (plain single-threaded zstd);
- gzip -6:      what the image would weigh as an ordinary gzip layer.

Each timing is the median of 3 runs (1 with --quick). Targets (the issue): shoal at
least 0.8x the throughput of `zstd -3 -T N`, and at most 1.03x the size of `zstd -3`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

sys.path.insert(0, str(common.REPO))
from tests.lab.fromdir import build_image

TORCH = "2.13.0"  # this exact version: its CPU wheel is on local disk (others pull GBs of CUDA)
THROUGHPUT_TARGET = 0.8
SIZE_TARGET = 1.03
STAMP = ".shoal-bench-complete"


# --- the trees ----------------------------------------------------------------------


def torch_venv(cache: Path) -> Path:
    """The ~1 GB tree: a venv with torch (CPU) and numpy, built once and cached."""
    venv = cache / "trees" / f"torch-{TORCH}-venv"
    if (venv / STAMP).is_file():
        common.say(f"tree: {venv} (cached)")
        return venv
    if venv.exists():
        common.say(f"tree: {venv} is incomplete, building it again")
        shutil.rmtree(venv)
    python3 = shutil.which("python3")
    if not python3:
        sys.exit("bench: python3 not found (needed to build the torch venv)")
    common.say(f"tree: building {venv} with python3 -m venv + pip install torch=={TORCH} numpy (once, a few minutes)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    common.run([python3, "-m", "venv", venv])
    common.run(
        [venv / "bin" / "python", "-m", "pip", "install", "--no-input", "--disable-pip-version-check",
         f"torch=={TORCH}", "numpy"],
        capture_output=False, stdout=sys.stderr, stderr=subprocess.PIPE,
    )
    probe = common.run([venv / "bin" / "python", "-c", "import torch, numpy; print(torch.__version__, numpy.__version__)"],
                       text=True)
    freeze = common.run([venv / "bin" / "python", "-m", "pip", "freeze"], text=True)
    (venv / STAMP).write_text(f"torch numpy: {probe.stdout.strip()}\n{freeze.stdout}")
    common.say(f"tree: built (torch numpy {probe.stdout.strip()})")
    return venv


def quick_tree(work: Path) -> Path:
    """The small tree: a Python stdlib, its interpreter and shoal's .venv site-packages."""
    tree = work / "quick-tree"
    stdlib = Path("/usr/lib/python3.11")
    binary = Path("/usr/bin/python3.11")
    if not stdlib.is_dir():  # not Debian: the running interpreter's own
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        binary = Path(os.path.realpath(sys.executable))
    site = sorted((common.REPO / ".venv" / "lib").glob("python3*/site-packages"))
    parts = [(stdlib, tree / "usr" / "lib" / stdlib.name), (binary, tree / "usr" / "bin" / binary.name)]
    parts += [(s, tree / "opt" / "venv" / s.relative_to(common.REPO / ".venv")) for s in site]
    for src, dst in parts:
        dst.parent.mkdir(parents=True, exist_ok=True)
        common.run(["cp", "-a", src, dst])
    common.say(f"tree: {', '.join(str(s) for s, _ in parts)}")
    return tree


# --- the image ----------------------------------------------------------------------


def layer_blob(oci_dir: Path) -> Path:
    """The (only) layer blob of the image tagged `src` in an OCI layout."""
    index = json.loads((oci_dir / "index.json").read_text())
    desc = next(
        (m for m in index["manifests"] if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == "src"),
        index["manifests"][0],
    )

    def blob(digest: str) -> Path:
        return oci_dir / "blobs" / digest.replace(":", "/", 1)

    layers = json.loads(blob(desc["digest"]).read_text())["layers"]
    if len(layers) != 1:
        sys.exit(f"bench: {oci_dir} has {len(layers)} layers, want 1")
    return blob(layers[0]["digest"])


def source_image(quick: bool, cache: Path, work: Path, keep: bool) -> Path:
    """A single-layer image with an uncompressed tar layer, at oci:DIR:src; returns DIR."""
    name = "quick" if quick else f"torch-{TORCH}"
    oci_dir = (cache / "images" / name) if keep else (work / "src")
    if keep and (oci_dir / STAMP).is_file():
        common.say(f"image: {oci_dir} (cached)")
        return oci_dir
    shutil.rmtree(oci_dir, ignore_errors=True)
    oci_dir.parent.mkdir(parents=True, exist_ok=True)
    tree = quick_tree(work) if quick else torch_venv(cache)
    common.say(f"image: packing {tree} into oci:{oci_dir}:src (uncompressed layer)")
    build_image([str(tree)], f"oci:{oci_dir}:src", compression="none", workdir=str(work))
    if quick:
        shutil.rmtree(tree, ignore_errors=True)
    (oci_dir / STAMP).write_text("")
    return oci_dir


# --- the measurements ---------------------------------------------------------------


def measure(quick: bool, keep: bool) -> dict:
    for tool in ("zstd", "gzip"):
        if not shutil.which(tool):
            sys.exit(f"bench: {tool} not found (apt-get install {tool})")
    if not common.SHOAL.is_file():
        sys.exit(f"bench: {common.SHOAL} not found (make install)")
    cache = common.cache_dir()
    repeat = 1 if quick else 3
    n = common.cores()
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-convert-"))
    try:
        src = source_image(quick, cache, work, keep)
        tar = layer_blob(src)
        tar_bytes = tar.stat().st_size
        common.say(f"layer tar: {tar_bytes / 1e6:,.1f} MB; {n} cores; {repeat} run(s) each")

        out = work / "out"

        def fresh() -> None:  # untimed, before every run: no output left, the tar in the page cache
            if out.is_dir():
                shutil.rmtree(out)
            elif out.exists():
                out.unlink()
            common.read_through(tar)

        summaries: list[dict] = []

        def shoal() -> None:
            proc = common.run([common.SHOAL, "convert", "--json", f"oci:{src}:src", f"oci:{out}:dst"], text=True)
            summaries.append(json.loads(proc.stdout))

        def zstd(*flags: str) -> None:
            common.run(["zstd", "-q", "-f", *flags, str(tar), "-o", str(out)])

        def gzip() -> None:
            with open(out, "wb") as f:
                common.run(["gzip", "-6", "-c", str(tar)], capture_output=False, stdout=f, stderr=subprocess.PIPE)

        results: dict[str, tuple[float, list[float], int]] = {}
        for key, label, fn in [
            ("shoal", "shoal convert", shoal),
            ("zstd_mt", f"zstd -3 -T{n}", lambda: zstd("-3", f"-T{n}")),
            ("zstd", "zstd -3", lambda: zstd("-3")),
            ("gzip", "gzip -6", gzip),
        ]:
            common.say(f"timing {label} ...")
            median, times, _ = common.timed(fn, repeat, before=fresh)
            if key == "shoal":
                size = summaries[-1]["layers"][0]["bytes_out"]
            else:
                size = out.stat().st_size
            results[key] = (median, times, size)
            common.say(f"  {label}: {', '.join(f'{t:.2f}s' for t in times)}; {size / 1e6:,.1f} MB")
        fresh()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    layer = summaries[-1]["layers"][0]
    if layer["action"] != "converted" or layer["bytes_in"] != tar_bytes:
        sys.exit(f"bench: shoal did not convert the whole layer: {layer}")
    layer_seconds = sorted(s["layers"][0]["seconds"] for s in summaries)[len(summaries) // 2]
    version = common.run(["zstd", "-V"], text=True).stdout
    zstd_version = (re.search(r"v\d+(\.\d+)+", version) or re.search(r".+", version)).group(0).strip()
    shoal_s, shoal_b = results["shoal"][0], results["shoal"][2]
    return {
        "quick": quick,
        "tree": "python stdlib + shoal .venv site-packages" if quick else f"venv with torch=={TORCH} (CPU) + numpy",
        "cores": n,
        "repeat": repeat,
        "zstd_version": zstd_version,
        "tar_bytes": tar_bytes,
        "files": layer["files"],
        "chunks": layer["chunks"],
        "shoal_seconds": round(shoal_s, 3),
        "shoal_layer_seconds": layer_seconds,
        "shoal_seconds_all": [round(t, 3) for t in results["shoal"][1]],
        "shoal_bytes": shoal_b,
        "zstd_mt_seconds": round(results["zstd_mt"][0], 3),
        "zstd_mt_bytes": results["zstd_mt"][2],
        "zstd_seconds": round(results["zstd_mt"][0], 3),  # the throughput baseline: zstd -3 -T<cores>
        "zstd_single_seconds": round(results["zstd"][0], 3),
        "zstd_bytes": results["zstd"][2],  # the size baseline: plain zstd -3
        "gzip_seconds": round(results["gzip"][0], 3),
        "gzip_bytes": results["gzip"][2],
        "throughput_ratio_vs_zstd": round(results["zstd_mt"][0] / shoal_s, 4),
        "throughput_ratio_vs_zstd_layer_only": round(results["zstd_mt"][0] / layer_seconds, 4) if layer_seconds else None,
        "size_ratio_vs_zstd": round(shoal_b / results["zstd"][2], 4),
        "size_ratio_vs_zstd_mt": round(shoal_b / results["zstd_mt"][2], 4),
        "size_ratio_vs_gzip": round(shoal_b / results["gzip"][2], 4),
        "throughput_target": THROUGHPUT_TARGET,
        "size_target": SIZE_TARGET,
        "throughput_target_met": results["zstd_mt"][0] / shoal_s >= THROUGHPUT_TARGET,
        "size_target_met": shoal_b / results["zstd"][2] <= SIZE_TARGET,
    }


def report(f: dict) -> str:
    n, tar = f["cores"], f["tar_bytes"]
    zs, zb = f["zstd_mt_seconds"], f["zstd_bytes"]
    rows = []
    for label, secs, size in [
        ("shoal convert", f["shoal_seconds"], f["shoal_bytes"]),
        ("  (layer only)", f["shoal_layer_seconds"], f["shoal_bytes"]),
        (f"zstd -3 -T{n}", f["zstd_mt_seconds"], f["zstd_mt_bytes"]),
        ("zstd -3", f["zstd_single_seconds"], f["zstd_bytes"]),
        ("gzip -6", f["gzip_seconds"], f["gzip_bytes"]),
    ]:
        rows.append([
            label, f"{secs:.2f}", f"{tar / secs / 1e6:,.1f}", f"{size / 1e6:,.1f}",
            f"{zs / secs:.3f}x", f"{size / zb:.4f}x",
        ])
    mode = "quick" if f["quick"] else "full"
    lines = [
        f"convert benchmark ({mode}): {f['tree']}",
        (
            f"layer tar {tar / 1e6:,.1f} MB, {f['files']:,} files, {f['chunks']:,} chunks; {n} cores; "
            f"median of {f['repeat']} run(s); zstd {f['zstd_version']}"
        ),
        "",
        common.table(
            ["", "seconds", "MB/s", "output MB", f"speed vs zstd -3 -T{n}", "size vs zstd -3"], rows
        ),
        "",
        f"shoal output vs gzip -6: {f['size_ratio_vs_gzip']:.4f}x",
    ]
    for what, value, target, ok, op in [
        (f"throughput vs zstd -3 -T{n} (whole command)", f["throughput_ratio_vs_zstd"], f["throughput_target"],
         f["throughput_target_met"], ">="),
        ("size vs zstd -3", f["size_ratio_vs_zstd"], f["size_target"], f["size_target_met"], "<="),
    ]:
        lines.append(f"target {what}: {value:.3f}x (want {op} {target}x)  {'PASS' if ok else 'MISS'}")
    return "\n".join(lines)


def main() -> int:
    p = common.parser("shoal convert against zstd -3 -T<cores>, zstd -3 and gzip -6 on the same layer tar")
    p.add_argument(
        "--keep-cache", action="store_true",
        help="also keep the built source image (the uncompressed layer tar) in the cache dir and reuse it "
        "next time; without it the image is built in a temporary dir and removed (the torch venv is always cached)",
    )
    args = p.parse_args()
    figures = measure(args.quick, args.keep_cache)
    common.emit(figures, report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
