"""The test harness's own promises (tests/conftest.py): what a test run leaves behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_PRINT_TMPDIR = "import os, tests.conftest; print(os.environ['TMPDIR'])"


def _import_conftest(env: dict) -> tuple[int, str]:
    """(pid, TMPDIR after the import) of a fresh interpreter that imports tests.conftest."""
    proc = subprocess.Popen([sys.executable, "-c", _PRINT_TMPDIR], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    return proc.pid, out.strip()


def test_a_process_a_test_starts_keeps_its_worker_s_temporary_directory():
    """A worker makes /tmp/shoal-<worker>-<pid> and removes it when it ends. A process a
    test starts inherits it; one that imports tests/conftest.py (test_tenancy's token
    server does) keeps it rather than making one of its own, which nobody would remove
    (found empty in /tmp after test runs)."""
    base = {k: v for k, v in os.environ.items() if k != "TMPDIR"}
    base["PYTHONPATH"] = str(REPO)
    worker = "gwharness"
    made: list[Path] = []
    try:
        # a worker: no directory of its worker in TMPDIR yet, so it makes its own
        pid, tmpdir = _import_conftest({**base, "PYTEST_XDIST_WORKER": worker})
        own = Path("/tmp") / f"shoal-{worker}-{pid}"
        made.append(own)
        assert tmpdir == str(own)
        assert own.is_dir()

        # a process started by that worker's test: it inherits the worker's directory
        inherited = Path("/tmp") / f"shoal-{worker}-{os.getpid()}"
        inherited.mkdir(mode=0o700)
        made.append(inherited)
        pid, tmpdir = _import_conftest({**base, "PYTEST_XDIST_WORKER": worker, "TMPDIR": str(inherited)})
        made.append(Path("/tmp") / f"shoal-{worker}-{pid}")
        assert tmpdir == str(inherited)
        assert not made[-1].exists()
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
