"""The node's side of the layer file system: start the server, talk to its socket (the
node's one control socket, ROOT/fs.sock: one typed method per op of snapshotter/fs/control.py)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from cache.source import BlobRef
from shoal import localrpc
from shoal.errors import DigestMismatch, FormatError, ShoalError
from shoal.fsutil import private_dir
from snapshotter.fs import holder
from snapshotter.fs.control import SOCKET_NAME, software_version

log = logging.getLogger("shoal.fs")


RESTART_BACKOFF = (0.2, 30.0)  # the supervisor's first and longest wait between restarts
WATCH_INTERVAL = 0.5  # how often the supervisor pings the server
PING_TIMEOUT = 5.0  # a ping not answered by then has failed
# A server that is alive but has not answered a ping for this long is hung: the supervisor
# kills it (by its PID) and starts another. Before that it waits: a second server beside a
# live one would serve the same FUSE session and take its control socket over.
HUNG_AFTER = 30.0


class FSClient:
    """Talks to the layer file system server of ROOT, starting it if it is not running.

    The server runs in its own session, so stopping the node leaves it (and every
    container's files) running; stop() ends it explicitly. Its FUSE session is kept by
    a descriptor holder (fs/holder.py), so a server that dies is replaced by one that
    takes the session over: `supervise` (the node) restarts a dead server with back-off,
    and at node start hands the session over to a server of the node's version.

    Every op raises ShoalError when the server answers an error (its message names the
    op), OSError when the socket cannot be reached, TimeoutError past `timeout`. Any thread.
    """

    def __init__(self, root: str, config: dict | None = None):
        self.root = os.path.abspath(root)
        self.config = config or {}
        self.sock_path = os.path.join(self.root, SOCKET_NAME)
        self.mnt = os.path.join(self.root, "mnt")
        self.pid: int | None = None
        self.version = ""  # the running server's (ping)
        self.restarts = 0  # by the supervisor
        self._start_lock = threading.Lock()
        self._stopped = False  # stop() was called: the supervisor restarts nothing
        self._watching = False

    def _call(self, op: str, timeout: float = 60.0, **args) -> dict:
        return localrpc.call(self.sock_path, {"op": op, **args}, timeout, "layer file system")

    def ping(self, timeout: float | None = None) -> dict:
        """{"pid"} of the server (and "listen_port" of its swarm, when it has one)."""
        return self._call("ping", timeout=PING_TIMEOUT if timeout is None else timeout)

    def running(self) -> bool:
        try:
            answer = self.ping()
            self.pid, self.version = answer["pid"], str(answer.get("version", ""))
            return os.path.ismount(self.mnt)
        except (OSError, ShoalError, ValueError):
            return False

    def ensure_running(self, timeout: float = 30.0) -> None:
        with self._start_lock:  # two prepares at once start one server
            self._ensure_running(timeout)

    def supervise(self, timeout: float = 30.0) -> None:
        """At node start: have a server of this node's version running (one of another
        version, from before an upgrade, hands its FUSE session over to a new one), and
        from now on restart a server that dies, with back-off and a log line. ShoalError
        when none can start now."""
        with self._start_lock:
            self._stopped = False
            if self.running() and not self.version:
                log.warning("layer file system server (pid %s) is from before session takeover: it cannot hand "
                            "its session over and keeps running (stop it when no container uses its layers)",
                            self.pid)
            elif self.running() and self.version != software_version():
                self._hand_over(timeout)
            self._ensure_running(timeout)
            if not self._watching:
                self._watching = True
                threading.Thread(target=self._watch, name="shoal-fs-supervisor", daemon=True).start()

    def release(self) -> None:
        """Stop supervising (the node is going; the server keeps running)."""
        self._stopped = True

    def _hand_over(self, timeout: float) -> None:
        """Have the running server exit leaving its session to the holder (SIGUSR1), and
        wait until it is gone: the next one may write NOTIFY_RESEND only once this one
        reads no more requests."""
        old_pid, old_version = self.pid, self.version
        if old_pid is None:
            return
        log.info("layer file system server (pid %d) is version %s, this node %s: handing its session over",
                 old_pid, old_version or "?", software_version())
        if not _signal_and_wait(old_pid, signal.SIGUSR1, timeout):
            raise ShoalError(f"layer file system server (pid {old_pid}) did not hand over within {timeout:.0f}s")

    def _watch(self) -> None:
        wait = RESTART_BACKOFF[0]
        silent_since: float | None = None  # when the live server stopped answering
        while True:
            time.sleep(WATCH_INTERVAL)
            if self._stopped:
                continue
            try:
                self.ping()
                silent_since = None
                continue
            except (OSError, ShoalError, ValueError):
                pass
            with self._start_lock:
                if self._stopped:
                    continue
                if self.running():  # (one started meanwhile: by supervise, or the node's prepare)
                    silent_since = None
                    continue
                if self.pid is not None and self._server_alive(self.pid):
                    now = time.monotonic()
                    if silent_since is None:
                        silent_since = now
                        log.warning("layer file system server (pid %d) does not answer but runs: waiting up to "
                                    "%.0fs before replacing it", self.pid, HUNG_AFTER)
                    if now - silent_since < HUNG_AFTER:
                        continue
                    log.error("layer file system server (pid %d) has not answered for %.0fs: killing it and "
                              "starting another (restart %d)", self.pid, now - silent_since, self.restarts + 1)
                    _signal_and_wait(self.pid, signal.SIGKILL, 10.0)  # (its FUSE session stays with the holder)
                silent_since = None
                log.warning("layer file system server (pid %s) does not answer: restarting it (restart %d)",
                            self.pid, self.restarts + 1)
                try:
                    if self._ensure_running(30.0):
                        self.restarts += 1
                    wait = RESTART_BACKOFF[0]
                    continue
                except ShoalError as e:
                    log.error("restarting the layer file system server: %s; next try in %.1fs", e, wait)
            time.sleep(wait)
            wait = min(wait * 2, RESTART_BACKOFF[1])

    def _ensure_running(self, timeout: float) -> bool:
        """Start a server unless one runs; True when this call started it. ShoalError
        when the known server runs but does not answer (never a second one beside it)."""
        if self.running():
            return False
        if self.pid is not None and self._server_alive(self.pid):
            raise ShoalError(f"layer file system server (pid {self.pid}) runs but does not answer on {self.sock_path}")
        private_dir(os.path.join(self.root, "logs"))
        log_path = os.path.join(self.root, "logs", "fs.log")
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # the layers' file names and errors: root's alone
        with os.fdopen(fd, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "snapshotter.fs.server", "--root", self.root,
                 "--config-json", json.dumps(self.config)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True,  # survives a restart of the node's control plane
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                with open(log_path, errors="replace") as f:
                    lines = [line.strip() for line in f.read()[-4000:].splitlines() if line.strip()]
                # its last ERROR line says why (the server logs one line, never a traceback)
                why = next((line.split(" ERROR ", 1)[1] for line in reversed(lines) if " ERROR " in line),
                           lines[-1] if lines else "no output")
                raise ShoalError(f"layer file system server exited with {proc.returncode}: {why} (log: {log_path})")
            if self.running():
                log.info("layer file system server running (pid %d) at %s", self.pid, self.mnt)
                return True
            time.sleep(0.05)
        raise ShoalError(f"layer file system server did not start within {timeout:.0f}s (log: {log_path})")

    def _server_alive(self, pid: int) -> bool:
        """`pid` is a live layer file system server of this root (not a PID reused since)."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            return False
        return b"snapshotter.fs.server" in args and os.fsencode(self.root) in args and _alive(pid)

    def load(self, layer_id: str) -> str:
        """Serve the layer ROOT/layers/`layer_id` (its blob.json written, with its TOC's
        location when toc.json is not there: the server reads the TOC through the node's
        fetch chain, within its read deadline); its mount point. DigestMismatch or
        FormatError when the layer's TOC is bad (nothing is mounted)."""
        timeout = 60.0 + float(self.config.get("read_deadline") or 0)  # (a TOC read, then its parse)
        reply = self._call("load", timeout=timeout, id=layer_id)
        if "refused" in reply:
            raise (DigestMismatch if reply.get("digest_mismatch") else FormatError)(str(reply["refused"]))
        return os.path.join(self.mnt, layer_id)

    def unload(self, layer_id: str) -> bool:
        """Stop serving the layer (its access trace goes); False if it was not loaded."""
        return bool(self._call("unload", id=layer_id)["unloaded"])

    def status(self, timeout: float = 60.0) -> dict:
        """{"layers": [per layer figures], "uptime_s", "ops", "prefetch", "store": the data
        path's figures (memory, chunk store, sources)}."""
        return self._call("status", timeout=timeout)

    def profile(self, layers: list[str] | None = None) -> list[list]:
        """The access trace of the loaded layers (or of `layers`, digests): [[layer
        digest, start, end], ...] in order of first use."""
        return self._call("profile", layers=layers)["chunks"]

    def prefetch(self, chunks: list | None = None, whole: list[str] | None = None,
                 part: tuple[int, int] = (0, 1), background: bool = False, sparse: tuple[str, ...] = ()) -> int:
        """Fetch the chunks of `chunks` (access profile entries) in their order and every
        chunk of the `whole` layers (digests) into the chunk store, on the server's own
        threads; the number of chunks queued now (entries of layers not loaded yet wait).
        `part`: node I of a preheat job's N fetches its own part of them first
        (prefetch/warmup.py rotation); 0 of 1 is not sent (a server before parts).
        `background`: a preheat's warm-up, which nobody waits on (cache.source.BACKGROUND);
        `sparse`: of those, the layers (digests) whose pieces the target fills sparsely are
        read as asked, not as whole pieces through the swarm (the region holds them to the
        ranges asked: p2p/ondemand.py)."""
        args = _entries(chunks, whole)
        if part[1] > 1:
            args["part"] = list(part)
        if background:
            args["background"] = True
        if sparse:
            args["sparse"] = list(sparse)
        return int(self._call("prefetch", **args)["queued"])

    def warmth(self, chunks: list | None = None, whole: list[str] | None = None) -> dict:
        """How much of those chunks is in the chunk store: {"layers": [{digest, loaded,
        target_chunks, target_bytes, warm_chunks, warm_bytes}], "prefetch": figures}."""
        return self._call("warmth", **_entries(chunks, whole))

    def prove(self, layer_id: str, urgent: bool = False, timeout: float = 60.0) -> dict:
        """The loaded layer's proof: {"diff_id"} or {"error", "final"} (fs/proof.py)."""
        return self._call("prove", timeout=timeout, id=layer_id, urgent=urgent)

    def provide_credentials(self, registry: str, repository: str, creds, ttl: float = 0.0) -> None:
        """The fetch chain reads `repository` with `creds` (builder.oci.auth.Credentials)
        for `ttl` seconds; None forgets them. Over the root-only control socket."""
        if creds is None:
            self._call("credentials", registry=registry, repository=repository)
        else:
            self._call("credentials", registry=registry, repository=repository, username=creds.username,
                       password=creds.password, ttl=ttl)

    def mark_bad(self, layer_id: str, reason: str) -> None:
        """Every open and read of the loaded layer fails from now on (EIO), after restarts too."""
        self._call("mark_bad", id=layer_id, reason=reason)

    def swarm_stats(self) -> dict:
        """The fetch chain's figures, with the swarm's (p2p/control.py `stats`)."""
        return self._call("stats", timeout=30)["stats"]

    def download(self, layer: str, timeout: float | None = None) -> dict:
        """Bulk: the whole blob of a layer this node provides (digest or hex) through the
        swarm, checked and seeded, within `timeout` seconds (the swarm's default: None):
        {"path", "seconds"} (p2p/control.py `download`)."""
        request = {"op": "download", "layer": layer, "timeout": timeout}
        return localrpc.call(self.sock_path, request, (timeout or 600.0) + 30, "layer file system")

    def fetch_blob(self, blob: BlobRef, metadata_wait: float, stall: float, timeout: float) -> str:
        """The whole blob (its size known) through the swarm's bulk path, into the torrent
        storage: the path of the complete file, checked against the blob's digest and
        seeded (p2p/control.py `fetch_blob`: waits up to `metadata_wait` s for a region
        that is filling the blob, gives up after `stall` s without a piece; `timeout`:
        the whole call, at most). ShoalError when the swarm cannot (it is off, no
        metadata, a stall, ...): the caller fetches the blob another way."""
        request = {"op": "fetch_blob", "blob": blob.to_dict(), "metadata_wait": metadata_wait, "stall": stall}
        return str(localrpc.call(self.sock_path, request, timeout, "layer file system")["path"])

    def forget_blob(self, blob: BlobRef, why: str) -> None:
        """Drop the blob's torrent and file from the swarm (its file proved bad)."""
        self._call("forget_blob", timeout=30, blob=blob.to_dict(), why=why)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server by its PID and wait until the mount is gone (the supervisor,
        if any, restarts nothing after this)."""
        self._stopped = True
        if not self.running() or self.pid is None:
            holder.drop(self.root)  # a session no server serves (one killed) ends too
            return
        os.kill(self.pid, 15)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and os.path.ismount(self.mnt):
            time.sleep(0.05)
        if os.path.ismount(self.mnt):
            subprocess.run(["umount", "-l", self.mnt], check=False)
        # After the unmount the server still writes pending chunks to ROOT/chunks: gone
        # means the process has exited, so nothing writes under ROOT after stop().
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.05)


def _entries(chunks: list | None, whole: list[str] | None) -> dict:
    """The request's chunks and whole layers (absent ones left out, as the server reads them)."""
    out: dict = {}
    if chunks is not None:
        out["chunks"] = [list(c) for c in chunks]
    if whole is not None:
        out["whole"] = list(whole)
    return out


def _signal_and_wait(pid: int, sig: int, timeout: float) -> bool:
    """Send `sig` to `pid` and wait for its end; False if it still runs after `timeout`."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.02)
    return not _alive(pid)


def _alive(pid: int) -> bool:
    """Process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
