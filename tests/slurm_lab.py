"""A private Slurm cluster on loopback for tests: Debian's munged, slurmctld and one
slurmd per node name, all on this machine (NodeHostname=localhost, NodeAddr=127.0.0.1,
a port per slurmd), with their own munge socket, slurm.conf (SLURM_CONF), state, spool,
logs and free ports. Every process is stopped by its PID, also when the start fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.services import START_TIMEOUT, free_port, stop_process

MUNGED = "/usr/sbin/munged"
SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
SBATCH = "/usr/bin/sbatch"
SCONTROL = "/usr/bin/scontrol"
MUNGE_KEY = "/etc/munge/munge.key"


def slurm_missing() -> str | None:
    """Why a Slurm cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (slurmd runs jobs as their users)"
    for path, package in ((MUNGED, "munge"), (SLURMCTLD, "slurmctld"), (SLURMD, "slurmd"),
                          (SBATCH, "slurm-client"), (MUNGE_KEY, "munge")):
        if not os.path.exists(path):
            return f"{path} is missing (Debian package {package})"
    return None


@dataclass
class SlurmCluster:
    workdir: Path
    conf: Path
    nodes: list[str]
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), capture_output=True, text=True, env=self.env(), timeout=60, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}\n{self.logs()}")
        return proc

    def sbatch(self, *args: str) -> str:
        """Submit a batch job; its id."""
        out = self.run(SBATCH, "--parsable", *args).stdout.strip()
        return out.split(";", 1)[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict ({} once Slurm has forgotten it)."""
        proc = self.run(SCONTROL, "show", "job", "-o", job_id, check=False)
        if proc.returncode != 0:
            return {}
        return dict(w.split("=", 1) for w in proc.stdout.split() if "=" in w)

    def wait_job(self, job_id: str, timeout: float = 300.0) -> dict[str, str]:
        """Wait until the job has ended: its last `scontrol show job` record."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                                        "BOOT_FAIL", "DEADLINE", "PREEMPTED"):
                return info
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} did not end within {timeout:.0f}s: {self.job(job_id)}\n{self.logs()}")

    def wait_idle(self, timeout: float = START_TIMEOUT * 2) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("/usr/bin/sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f}s\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for p in sorted((self.workdir / "log").glob("*")):
            parts.append(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        for proc in reversed(self._procs):
            stop_process(proc)


def slurm_conf(workdir: Path, nodes: list[str], prolog: str = "", extra: str = "") -> str:
    ports = [free_port(), free_port()]
    # the slurmds' ports are one range (Port=[LO-HI]): the first free one from a free port
    lo = next(b for b in range(free_port(), 65536 - len(nodes)) if all(_port_free(b + i) for i in range(len(nodes))))
    hi = lo + len(nodes) - 1
    names = ",".join(nodes)
    lines = [
        "ClusterName=shoaltest",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={workdir}/munge/munge.socket",
        f"StateSaveLocation={workdir}/state",
        f"SlurmdSpoolDir={workdir}/spool/%n",
        f"SlurmctldPidFile={workdir}/slurmctld.pid",
        f"SlurmdPidFile={workdir}/slurmd-%n.pid",
        f"SlurmctldLogFile={workdir}/log/slurmctld.log",
        f"SlurmdLogFile={workdir}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/linear",
        "MpiDefault=none",
        "ReturnToService=2",
        *([f"Prolog={prolog}"] if prolog else []),
        extra,
        f"NodeName={names} NodeHostname=localhost NodeAddr=127.0.0.1 Port=[{lo}-{hi}] CPUs=1 State=UNKNOWN",
        f"PartitionName=shoal Nodes={names} Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def start_slurm(workdir: Path, nodes: list[str], prolog: str = "", extra: str = "") -> SlurmCluster:
    """munged, slurmctld and a slurmd per name in `nodes`, under `workdir`."""
    for d in ("munge", "state", "spool", "log"):
        (workdir / d).mkdir(parents=True, exist_ok=True)
    os.chmod(workdir / "munge", 0o711)
    conf = workdir / "slurm.conf"
    conf.write_text(slurm_conf(workdir, nodes, prolog, extra))
    cluster = SlurmCluster(workdir, conf, nodes)
    log = workdir / "log"

    def spawn(name: str, *argv: str) -> None:
        with open(log / f"{name}.out", "ab") as out:
            cluster._procs.append(subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out,
                                                   stderr=subprocess.STDOUT, env=cluster.env(), cwd=workdir))

    try:
        munge = workdir / "munge"
        spawn("munged", MUNGED, "-F", "--force", f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
              f"--log-file={log}/munged.log", f"--seed-file={munge}/seed", f"--key-file={MUNGE_KEY}")
        _wait_path(munge / "munge.socket", cluster)
        spawn("slurmctld", SLURMCTLD, "-D", "-f", str(conf))
        for node in nodes:
            spawn(f"slurmd-{node}", SLURMD, "-D", "-f", str(conf), "-N", node)
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_path(path: Path, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in cluster._procs):
            raise RuntimeError(f"{path} did not appear\n{cluster.logs()}")
        time.sleep(0.05)


def remove(workdir: Path) -> None:
    shutil.rmtree(workdir, ignore_errors=True)
