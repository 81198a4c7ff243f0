"""The realistic training image of the end-to-end test and the lazy-start benchmark.

"Debian bookworm minbase from `debootstrap`, plus a venv with torch 2.13.0 CPU and numpy:
about 1.1 GB in two gzip layers."

- layer 1: `debootstrap --variant=minbase --include=python3 bookworm DIR MIRROR`, MIRROR
  being the Debian URI apt itself uses (/etc/apt/sources.list.d/*.sources or
  /etc/apt/sources.list); apt's .deb cache and lists and the contents of /proc, /sys and
  /dev removed.
- layer 2: /opt/venv/site-packages: the site-packages of a host venv (Debian's
  /usr/bin/python3.11 -m venv; `pip install torch==2.13.0 numpy`). The image runs
  Debian's /usr/bin/python3 with PYTHONPATH=/opt/venv/site-packages.

Every .pyc in the image (Debian's standard library and the venv) is compiled again as an
*unchecked-hash* pyc: the image builder clamps file times to 2024-01-01, which would
leave timestamp pycs stale, so every container would compile torch again on import.

Both layers are checked with a chroot (`import torch` and a small sum) before packing.

    torch_image_layout()     -> Path   OCI layout, gzip layers, tag "torch"
    torch_image_converted()  -> Path   the same after `shoal convert`, tag "torch"
    push(layout, tag, host)  -> str    copy a layout image to a registry ("HOST/REPO:TAG")

Built once (needs root, a few minutes) into $SHOAL_TEST_CACHE or ~/.cache/shoal-test,
under torch-image-v1/: built in a temporary directory and renamed into place, so a
present directory is a complete one; a lock file serialises concurrent builders. The
converted layout is keyed by a hash of the converter's sources (builder/*.py), so a
change to the format makes a fresh one.

    .venv/bin/python -m tests.torchimage [--converted] [--rebuild]   # build, print paths and timings
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.lab.fromdir import ImageConfig, build_image
from tests.services import mounts_under, unmount_under

VERSION = "torch-image-v1"
TAG = "torch"
TORCH = "2.13.0"  # exactly this: its CPU wheel is on local disk (others pull GBs of CUDA builds)
SUITE = "bookworm"
HOST_PYTHON = "/usr/bin/python3.11"  # Debian's, the same interpreter the image runs
SITE = "/opt/venv/site-packages"
ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", f"PYTHONPATH={SITE}"]
CMD = ["python3", "-c", "import torch; print(torch.ones(2,2).sum())"]
EXPECTED = "tensor(4.)"  # what CMD prints
INFO = "shoal-image-info.json"  # inside each cached layout: what it is, how long it took

# converter sources whose change makes a new converted layout
_CONVERTER_SOURCES = ("builder",)


def say(message: str) -> None:
    print(f"[torchimage] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    root = Path(os.environ.get("SHOAL_TEST_CACHE") or Path.home() / ".cache" / "shoal-test")
    return root / VERSION


@contextlib.contextmanager
def _locked(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another build holding {root / '.lock'}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _run(cmd: list, what: str, **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    proc = subprocess.run([str(c) for c in cmd], check=False, stdin=subprocess.DEVNULL, **kwargs)
    if proc.returncode != 0:
        err = (proc.stderr or "")[-3000:] if isinstance(proc.stderr, str) else ""
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n{err}")
    return proc


def _rmtree(path: Path) -> None:
    """Remove a build tree, never through a mount left inside it."""
    if not path.exists():
        return
    left = unmount_under(path)
    if left:
        raise RuntimeError(f"refusing to remove {path}: still mounted: {left}")
    shutil.rmtree(path, ignore_errors=True)


# --- the Debian mirror apt uses ----------------------------------------------------------


def debian_mirror() -> str:
    """The URI apt uses for the `bookworm` suite (deb822 .sources first, then .list files)."""
    d = Path("/etc/apt/sources.list.d")
    for path in sorted(d.glob("*.sources")) if d.is_dir() else []:
        for stanza in re.split(r"\n\s*\n", path.read_text(errors="replace")):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line:
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            if fields.get("enabled", "yes").lower() == "no":
                continue
            if "deb" in fields.get("types", "").split() and SUITE in fields.get("suites", "").split():
                uris = fields.get("uris", "").split()
                if uris:
                    return uris[0]
    lists = [Path("/etc/apt/sources.list")] + (sorted(d.glob("*.list")) if d.is_dir() else [])
    for path in lists:
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            words = re.sub(r"\[[^\]]*\]", "", line.split("#", 1)[0]).split()
            if len(words) >= 3 and words[0] == "deb" and words[2] == SUITE:
                return words[1]
    raise RuntimeError(f"no apt source for Debian {SUITE} in /etc/apt (needed by debootstrap)")


# --- building the trees -------------------------------------------------------------------


def _need_root_tools() -> None:
    if os.geteuid() != 0:
        raise RuntimeError("building the torch image needs root (debootstrap, chroot)")
    if not shutil.which("debootstrap"):
        raise RuntimeError("debootstrap is not installed (apt-get install debootstrap; scripts/install.sh)")
    if not os.access(HOST_PYTHON, os.X_OK):
        raise RuntimeError(f"{HOST_PYTHON} not found (Debian's python3.11, for the venv)")


def _base_layer(root: Path) -> None:
    mirror = debian_mirror()
    say(f"layer 1: debootstrap --variant=minbase --include=python3 {SUITE} {root} {mirror} (about 2 minutes)")
    t = time.monotonic()
    try:
        _run(["debootstrap", "--variant=minbase", "--include=python3", SUITE, root, mirror], "debootstrap")
    finally:
        unmount_under(root)  # debootstrap unmounts its /proc and /sys itself; be sure
    say(f"layer 1: debootstrap done in {time.monotonic() - t:.0f}s")


def _clean_base(root: Path) -> None:
    """apt's caches and lists, logs, and what runtimes provide (/proc, /sys, /dev: the
    chroot check uses debootstrap's /dev/urandom, so this runs after it)."""
    if mounts_under(root):
        raise RuntimeError(f"still mounted under {root}: {mounts_under(root)}")
    for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*", "proc/*", "sys/*", "dev/*",
                    "var/cache/apt/*.bin", "var/log/*.log", "var/log/apt/*", "debootstrap"):
        for p in root.glob(pattern):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.is_file() or p.is_symlink() or p.exists():
                p.unlink()
    for d, mode in (("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("tmp", 0o1777)):
        (root / d).mkdir(exist_ok=True)
        os.chmod(root / d, mode)


def _venv_site_packages(work: Path, dest: Path) -> None:
    venv = work / "venv"
    say(f"layer 2: {HOST_PYTHON} -m venv; pip install torch=={TORCH} numpy")
    t = time.monotonic()
    _run([HOST_PYTHON, "-m", "venv", venv], "python3 -m venv")
    _run(
        [venv / "bin/python", "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "--no-compile",
         "--no-warn-script-location", f"torch=={TORCH}", "numpy"],
        "pip install torch numpy",
    )
    freeze = _run([venv / "bin/python", "-m", "pip", "freeze"], "pip freeze").stdout
    say(f"layer 2: pip done in {time.monotonic() - t:.0f}s: {' '.join(freeze.split())}")
    site = next((venv / "lib").glob("python3*/site-packages"))
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.rename(site, dest)
    for p in list(dest.glob("pip")) + list(dest.glob("pip-*.dist-info")):  # not used by the image
        shutil.rmtree(p)
    shutil.rmtree(venv)


def _compile(root: Path) -> None:
    """Every .pyc in the tree as an unchecked-hash pyc (valid whatever the file times)."""
    for stale in root.rglob("__pycache__"):
        if stale.is_dir():
            shutil.rmtree(stale)
    dirs = [root / "usr/lib/python3.11", root / "usr/lib/python3/dist-packages", root / SITE.lstrip("/")]
    dirs = [d for d in dirs if d.is_dir()]
    say(f"compiling .pyc files (unchecked-hash) under {', '.join('/' + str(d.relative_to(root)) for d in dirs)}")
    t = time.monotonic()
    # host python3.11 = the image's python3.11 (same magic number); -s/-p: paths as in the image
    proc = subprocess.run(
        [HOST_PYTHON, "-m", "compileall", "-q", "-f", "-j0", "--invalidation-mode", "unchecked-hash",
         "-s", str(root), "-p", "/", "-x", r"/(test|tests)/.*(bad|badsyntax|_py2)", *map(str, dirs)],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False,
    )
    # a few files in wheels are not valid Python 3.11 (templates, test data): not fatal
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("***")]
    say(f"compiled in {time.monotonic() - t:.0f}s ({len(errors)} file(s) not compilable)")


def _chroot_check(root: Path) -> None:
    """`import torch` and a sum with the image's own python3, in a chroot; and no .pyc
    written by it (so the image's pycs are valid)."""
    stamp = time.time()
    time.sleep(0.01)
    cmd = ["chroot", str(root), "/usr/bin/env", "-i", *ENV, "python3", "-c",
           "import torch, numpy; print(torch.ones(2,2).sum(), torch.__version__, numpy.__version__)"]
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if proc.returncode != 0:
        say("chroot check failed without /proc; trying again with /proc mounted")
        proc_dir = root / "proc"
        _run(["mount", "-t", "proc", "proc", proc_dir], "mount proc")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
        finally:
            subprocess.run(["umount", str(proc_dir)], check=False)
            if mounts_under(proc_dir):
                subprocess.run(["umount", "-l", str(proc_dir)], check=False)
    if proc.returncode != 0 or not proc.stdout.startswith(EXPECTED):
        raise RuntimeError(f"chroot check failed: {' '.join(cmd)}\n{proc.stdout}{proc.stderr[-3000:]}")
    written = [p for p in root.rglob("*.pyc") if p.stat().st_mtime > stamp]
    say(f"chroot check: {proc.stdout.strip()}; .pyc files written by the import: {len(written)}")
    if written:
        raise RuntimeError(f"the import wrote {len(written)} .pyc file(s), e.g. {written[0]}: stale pycs in the image")


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            total += st.st_size
    return total


def _layout_info(layout: Path, tag: str = TAG) -> dict:
    index = json.loads((layout / "index.json").read_text())
    desc = next(m for m in index["manifests"]
                if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag)
    manifest = json.loads((layout / "blobs" / desc["digest"].replace(":", "/", 1)).read_text())
    return {
        "manifest": desc["digest"],
        "layers": [{"digest": x["digest"], "size": x["size"], "mediaType": x["mediaType"]} for x in manifest["layers"]],
        "compressed_bytes": sum(x["size"] for x in manifest["layers"]),
    }


def _build_layout(dest: Path) -> dict:
    _need_root_tools()
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=dest.parent))
    try:
        base, top = work / "base", work / "top"
        base.mkdir()
        _base_layer(base)
        # the venv goes into the base tree for the chroot check, then moves to its own layer
        _venv_site_packages(work, base / SITE.lstrip("/"))
        _compile(base)
        _chroot_check(base)
        _clean_base(base)
        top.mkdir(mode=0o755)
        (top / "opt").mkdir(mode=0o755)
        os.rename(base / "opt" / "venv", top / "opt" / "venv")
        os.chmod(top, 0o755)
        sizes = [_tree_bytes(base), _tree_bytes(top)]
        say(f"trees: base {sizes[0] / 1e6:,.0f} MB, venv {sizes[1] / 1e6:,.0f} MB; packing gzip layers")
        t = time.monotonic()
        out = work / "layout"
        config = ImageConfig(
            cmd=list(CMD), env=list(ENV),
            labels={"org.opencontainers.image.title": f"shoal test: Debian {SUITE} minbase + torch {TORCH} CPU"},
        )
        build_image([str(base), str(top)], f"oci:{out}:{TAG}", config=config, compression="gzip", workdir=str(work))
        info = {
            "what": f"Debian {SUITE} minbase (debootstrap) + {SITE} with torch=={TORCH} (CPU) and numpy",
            "tree_bytes": sum(sizes),
            "layer_tree_bytes": sizes,
            **_layout_info(out),
            "pack_seconds": round(time.monotonic() - t, 1),
            "build_seconds": round(time.monotonic() - t0, 1),
        }
        (out / INFO).write_text(json.dumps(info, indent=2))
        _rmtree(base)
        _rmtree(top)
        os.rename(out, dest)
        return info
    finally:
        _rmtree(work)


def _converter_key() -> str:
    h = hashlib.sha256()
    for top in _CONVERTER_SOURCES:
        for path in sorted((REPO / top).rglob("*.py")):
            h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _shoal() -> str:
    for candidate in (Path(sys.executable).parent / "shoal", REPO / ".venv/bin/shoal"):
        if candidate.is_file():
            return str(candidate)
    raise RuntimeError("the shoal command is not installed (make install)")


# --- the API -------------------------------------------------------------------------------


def torch_image_layout(rebuild: bool = False) -> Path:
    """The gzip image (OCI layout, tag "torch"), built once and cached."""
    root = cache_root()

    def build(dest: Path) -> None:
        for old in root.glob(".build-*"):  # left by a build that was killed
            _rmtree(old)
        t = time.monotonic()
        info = _build_layout(dest)
        say(
            f"built {dest} in {time.monotonic() - t:.0f}s: {info['tree_bytes'] / 1e6:,.0f} MB of files, "
            f"{info['compressed_bytes'] / 1e6:,.0f} MB in {len(info['layers'])} gzip layers"
        )

    return _cached(root / "gzip", rebuild, build)


def _cached(dest: Path, rebuild: bool, build) -> Path:
    """`dest` in the cache, made by build(dest) under the cache's lock unless it is there
    already (or `rebuild` asks for it anew)."""
    if dest.is_dir() and not rebuild:
        return dest
    with _locked(dest.parent):
        if dest.is_dir() and rebuild:
            _rmtree(dest)
        if not dest.is_dir():
            build(dest)
    return dest


def torch_image_converted(rebuild: bool = False) -> Path:
    """The image after `shoal convert` (OCI layout, tag "torch"), cached per converter version."""
    src = torch_image_layout()
    root = cache_root()
    key = _converter_key()

    def build(dest: Path) -> None:
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
        try:
            say(f"shoal convert oci:{src}:{TAG} -> {dest.name}")
            t = time.monotonic()
            proc = _run([_shoal(), "convert", "--json", f"oci:{src}:{TAG}", f"oci:{tmp / 'layout'}:{TAG}"],
                        "shoal convert")
            seconds = time.monotonic() - t
            summary = json.loads(proc.stdout)
            info = {"converter_key": key, "convert_seconds": round(seconds, 1), "convert": summary,
                    **_layout_info(tmp / "layout")}
            (tmp / "layout" / INFO).write_text(json.dumps(info, indent=2))
            os.rename(tmp / "layout", dest)
            say(f"converted in {seconds:.0f}s: {info['compressed_bytes'] / 1e6:,.0f} MB")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # older converter versions: keep the two newest (a concurrent user may still read one)
        older = sorted((p for p in root.glob("converted-*") if p != dest), key=lambda p: p.stat().st_mtime)
        for old in older[:-2]:
            shutil.rmtree(old, ignore_errors=True)

    return _cached(root / f"converted-{key}", rebuild, build)


def image_info(layout: Path) -> dict:
    """What a cached layout records about itself (sizes, layers, build times)."""
    path = layout / INFO
    return json.loads(path.read_text()) if path.is_file() else _layout_info(layout)


def push(layout: Path | str, tag: str, registry_host: str, repo: str = "torch", dest_tag: str | None = None,
         plain_http: bool = True) -> str:
    """Copy the image tagged `tag` in `layout` to `registry_host/repo:dest_tag` unchanged
    (dest_tag defaults to tag); returns "HOST/REPO:TAG"."""
    from builder.oci.refs import open_destination, open_source
    from tests.imagetools import copy_image

    dest_tag = dest_tag or tag
    ref = f"{registry_host}/{repo}:{dest_tag}"
    work = Path(tempfile.mkdtemp(prefix="shoal-push-"))
    try:
        t = time.monotonic()
        with open_source(f"oci:{layout}:{tag}") as src, open_destination(f"docker://{ref}", plain_http) as dst:
            copy_image(src, dst, work)
        say(f"pushed oci:{layout}:{tag} to {ref} in {time.monotonic() - t:.1f}s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ref


def main() -> int:
    p = argparse.ArgumentParser(description="build (or find) the cached torch test image and print its paths")
    p.add_argument("--converted", action="store_true", help="also the shoal-converted layout")
    p.add_argument("--rebuild", action="store_true", help="build again even when cached")
    args = p.parse_args()
    t = time.monotonic()
    layout = torch_image_layout(rebuild=args.rebuild)
    say(f"gzip layout: {layout} ({time.monotonic() - t:.1f}s)")
    out = {"gzip": str(layout), "gzip_seconds": round(time.monotonic() - t, 2), "gzip_info": image_info(layout)}
    if args.converted:
        t = time.monotonic()
        conv = torch_image_converted(rebuild=args.rebuild)
        say(f"converted layout: {conv} ({time.monotonic() - t:.1f}s)")
        out.update(converted=str(conv), converted_seconds=round(time.monotonic() - t, 2),
                   converted_info={k: v for k, v in image_info(conv).items() if k != "convert"})
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
