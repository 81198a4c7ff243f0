"""Real root file systems for test images, made from what this machine has installed:
Debian's busybox-static, Debian's python3.11 with its shared libraries and standard
library. Paths include odd names so code that leaves its root or mangles names breaks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

BUSYBOX = "/bin/busybox"
PYTHON = "/usr/bin/python3.11"
ODD_NAMES = ["with space.txt", "ünïcödé-名前.txt", "-leading-dash", "tab\there", "x" * 200]


def busybox_layer(root: Path) -> Path:
    """/bin/busybox, its applets as symlinks, /etc, odd names, a hard link, an empty file,
    a fifo, a setuid file, a deep tree and an xattr (when the file system allows one)."""
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin/busybox")
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    etc = root / "etc"
    etc.mkdir()
    (etc / "motd").write_text("hello from a shoal test image\n")
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    data = root / "data"
    data.mkdir()
    for name in ODD_NAMES:
        (data / name).write_text(f"content of {name!r}\n")
    (data / "empty").touch()
    (data / "link-to-motd").symlink_to("../etc/motd")
    os.link(etc / "motd", data / "hardlink-to-motd")
    os.mkfifo(data / "fifo")
    (data / "setuid").write_text("#!/bin/sh\n")
    os.chmod(data / "setuid", 0o4755)
    deep = data
    for i in range(20):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    (deep / "bottom").write_text("deep\n")
    os.chown(data / "with space.txt", 1234, 5678)
    try:
        os.setxattr(data / "empty", "user.shoal.test", b"xattr-value")
    except OSError:
        pass
    for d in ("tmp", "proc", "sys", "dev", "root"):
        (root / d).mkdir()
    os.chmod(root / "tmp", 0o1777)
    return root


def _copy_file(src: str, root: Path) -> None:
    dst = root / src.lstrip("/")
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(os.path.realpath(src), dst)


def python_layer(root: Path, stdlib: bool = True) -> Path:
    """Debian's python3.11 binary, the shared libraries it links, and its standard
    library (without the test suite) — a tree with large files that get cut into chunks."""
    _copy_file(PYTHON, root)
    (root / "usr/bin/python3").symlink_to("python3.11")
    out = subprocess.run(["ldd", PYTHON], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            _copy_file(path, root)
    if stdlib:
        shutil.copytree(
            "/usr/lib/python3.11",
            root / "usr/lib/python3.11",
            symlinks=True,
            ignore=shutil.ignore_patterns("test", "__pycache__", "idlelib", "tkinter", "ensurepip"),
        )
    return root


def delta_layer(root: Path) -> Path:
    """A layer on top of busybox_layer: a deleted file, an opaque dir, a changed file."""
    data = root / "data"
    data.mkdir(parents=True)
    (data / ".wh.-leading-dash").touch()  # whiteout: delete /data/-leading-dash
    (data / "d0").mkdir()
    (data / "d0" / ".wh..wh..opq").touch()  # opaque: hide the lower d0 tree
    (data / "d0" / "new").write_text("replaces the deep tree\n")
    (root / "etc").mkdir()
    (root / "etc/motd").write_text("changed by the top layer\n")
    return root


def special_layer(root: Path, entries: int = 3000) -> Path:
    """Device nodes, a sparse file, an empty directory and a large directory."""
    dev = root / "dev"
    dev.mkdir(parents=True)
    os.mknod(dev / "null", 0o020666, os.makedev(1, 3))  # character device
    os.mknod(dev / "loop9", 0o060660, os.makedev(7, 9))  # block device
    big = root / "var/sparse"
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:
        f.truncate(6 << 20)  # a 6 MiB hole ...
        f.seek(6 << 20)
        f.write(b"end of a sparse file\n")  # ... then data
    (root / "var/empty-dir").mkdir()
    many = root / "var/many"
    many.mkdir()
    for i in range(entries):
        (many / f"entry-{i:05d}").write_text(f"{i}\n")
    return root


def lazy_app_image(registry, root: Path, repo: str, cmd: list[str], salt: str = "") -> tuple[str, str, dict]:
    """busybox + python + delta layers pushed as REPO:gzip and converted to REPO:lazy:
    (gzip reference, lazy reference, the lazy image's manifest). `salt`: a file
    /.shoal-salt-N with it in each layer, so the layers are not those of an unsalted build."""
    import json

    from builder.convert import convert
    from builder.oci.refs import open_source
    from tests.lab.fromdir import ImageConfig, build_image

    layers = [busybox_layer(root / "l1"), python_layer(root / "l2"), delta_layer(root / "l3")]
    for i, layer in enumerate(layers):
        if salt:
            (layer / f".shoal-salt-{i}").write_text(salt + "\n")
    gz = f"{registry.host}/{repo}:gzip"
    build_image([str(p) for p in layers], f"docker://{gz}", ImageConfig(cmd=cmd), plain_http=True,
                workdir=str(root))
    lazy = f"{registry.host}/{repo}:lazy"
    convert(f"docker://{gz}", f"docker://{lazy}", plain_http=True)
    with open_source(f"docker://{lazy}", plain_http=True) as s:
        manifest = json.loads(s.get_root().data)
    return gz, lazy, manifest
