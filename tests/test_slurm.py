"""The job-launch hook for real: Debian's Slurm (munged, slurmctld, two slurmds named n1
and n2 on loopback) runs deploy/slurm/prolog.sh before a job whose comment names a
shoal image; the job's step then does a lazy start through containerd and `shoal node`.

Both slurmd node names live on this one machine and share one `shoal node` (one root,
one containerd): Slurm picks n1 or n2, the prolog and the step use the same node.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.lab.netlab import registry_log
from tests.rootfs import lazy_app_image
from tests.services import CTR_BIN, SHOAL
from tests.slurm_lab import slurm_missing, start_slurm

pytestmark = [pytest.mark.registry, pytest.mark.containerd]

REPO = Path(__file__).resolve().parent.parent
PROLOG = REPO / "deploy/slurm/prolog.sh"
CMD = ["/bin/sh", "-c", "cat /etc/motd; /usr/bin/python3 -c 'import json, email; print(json.dumps([6 * 7]))'"]


@pytest.fixture(scope="module")
def registry(module_registry):
    return module_registry


@pytest.fixture(scope="module")
def image(registry, tmp_path_factory):
    _, lazy, manifest = lazy_app_image(registry, tmp_path_factory.mktemp("slurm image"), "slurm/app", CMD)
    return lazy, manifest


@pytest.fixture
def cluster(node_and_containerd):
    reason = slurm_missing()
    if reason:
        pytest.skip(reason)
    work = Path(tempfile.mkdtemp(prefix="shoal-slurm-", dir="/tmp"))
    os.chmod(work, 0o755)
    wrapper = work / "prolog"
    # The shipped prolog, pointed at the test's settings file (slurmd's Prolog
    # environment carries no variables of ours).
    wrapper.write_text(f"#!/bin/sh\nSHOAL_PROLOG_CONFIG={work}/prolog.conf exec {PROLOG}\n")
    wrapper.chmod(0o755)
    slurm = start_slurm(work, ["n1", "n2"], prolog=str(wrapper))
    try:
        yield slurm, node_and_containerd
    finally:
        slurm.stop()
        shutil.rmtree(work, ignore_errors=True)


def write_settings(work: Path, root: Path, **extra: str) -> None:
    settings = {"SHOAL": SHOAL, "SHOAL_ROOT": str(root), "SHOAL_PREFETCH_TIMEOUT": "120",
                "SHOAL_PROLOG_LOG": str(work / "prolog.log"), "SCANCEL": "/usr/bin/scancel", **extra}
    lines = [f"export PYTHONPATH={shlex.quote(str(REPO))}"]  # the shoal code under test
    lines += [f"{k}={shlex.quote(v)}" for k, v in settings.items()]
    lines.append(f"export SLURM_CONF={shlex.quote(str(work / 'slurm.conf'))}")  # for scancel
    (work / "prolog.conf").write_text("\n".join(lines) + "\n")


def step_script(work: Path, registry, ref: str, root: Path, ctd, mode: str) -> Path:
    """The job's step: how warm the node is as it starts (measured by the node), then the
    lazy start, with the registry's log copied before it."""
    q = shlex.quote
    run = " ".join(q(a) for a in CMD)
    script = work / "step.sh"
    script.write_text(f"""#!/bin/sh
set -e
cp {q(str(registry.log_path))} {q(str(work / 'registry-start.log'))}
{q(SHOAL)} prefetch {q(ref)} --root {q(str(root))} --mode {mode} --node-name "$SLURMD_NODENAME" --json > {q(str(work / 'warm.json'))}
{q(SHOAL)} pull {q(ref)} --address {q(ctd.address)} --namespace shoal-test --json > {q(str(work / 'pull.json'))}
{CTR_BIN} --address {q(ctd.address)} --namespace shoal-test run --rm --snapshotter shoal {q(ref)} slurm-job {run} \
    > {q(str(work / 'ctr.out'))}
echo "step done on $SLURMD_NODENAME"
""")
    script.chmod(0o755)
    return script


def layer_bytes(entries: list[dict], manifest: dict) -> int:
    digests = [ly["digest"] for ly in manifest["layers"]]
    return sum(int(e.get("http.response.written", 0)) for e in entries
               if e["http.request.method"] == "GET" and any(d in e.get("http.request.uri", "") for d in digests))


@pytest.mark.parametrize("mode", ["full", "profile"])
def test_prolog_warms_the_node_before_the_step_and_the_step_reads_nothing_from_the_registry(
        registry, image, cluster, mode):
    """mode profile: the whole flow, CI (`shoal profile record --push` of the command the
    job runs), scheduler (the prolog), node (the step's lazy start)."""
    ref, manifest = image
    slurm, (node, ctd) = cluster
    work = slurm.workdir
    if mode == "profile":
        recorded = subprocess.run([SHOAL, "profile", "record", ref, "--push", "--replace", "--", *CMD],
                                  capture_output=True, text=True, timeout=300, check=False)
        assert recorded.returncode == 0, recorded.stderr
    write_settings(work, node.root, SHOAL_PREFETCH_MODE=mode)
    step = step_script(work, registry, ref, node.root, ctd, mode)
    job = slurm.sbatch("-N1", f"--comment=shoal:{ref}", f"--chdir={work}", f"--output={work}/job.out", str(step))
    info = slurm.wait_job(job)
    out = (work / "job.out").read_text(errors="replace") if (work / "job.out").exists() else ""
    assert info["JobState"] == "COMPLETED", f"{info}\n{out}\n{slurm.logs()}"
    ran_on = info["NodeList"]
    assert ran_on in ("n1", "n2") and f"step done on {ran_on}" in out
    # the prolog ran for this job on that node and found the node warm
    lines = [ln for ln in (work / "prolog.log").read_text().splitlines() if f"job={job} " in ln]
    assert len(lines) == 1, lines
    assert f"node={ran_on} image={ref} state=warm" in lines[0] and f"node {ran_on} warm" in lines[0]
    # ... before the step started: the node's own measure, taken by the step
    warm = json.loads((work / "warm.json").read_text())
    assert warm["state"] == "ready" and warm["manifest"].startswith("sha256:")
    (n,) = warm["nodes"]
    assert n["name"] == ran_on and n["state"] == "warm" and n["warm_bytes"] == n["target_bytes"] > 0
    if mode == "full":
        assert n["target_bytes"] > 1_000_000
    else:
        assert warm["profile_chunks"] > 0 and n["target_bytes"] < sum(ly["size"] for ly in manifest["layers"]) / 2
    # the step's lazy start read no layer bytes from the origin
    assert [ly["kind"] for ly in json.loads((work / "pull.json").read_text())["layers"]] == ["lazy"] * 3
    assert "changed by the top layer" in (work / "ctr.out").read_text()
    start, end = registry_log(work / "registry-start.log"), registry_log(registry.log_path)
    assert layer_bytes(end[len(start):], manifest) == 0
    assert layer_bytes(start, manifest) >= n["target_bytes"]  # the prolog fetched them


def test_a_job_without_a_shoal_comment_is_left_alone_and_a_cold_node_never_fails_the_job(
        registry, cluster):
    slurm, (node, _) = cluster
    work = slurm.workdir
    write_settings(work, node.root, SHOAL_PREFETCH_TIMEOUT="20")
    plain = slurm.sbatch("-N1", "--comment=just a job", f"--chdir={work}", "--output=/dev/null", "--wrap=true")
    assert slurm.wait_job(plain)["JobState"] == "COMPLETED"
    assert not (work / "prolog.log").exists()
    # an image that cannot be warmed (none such): default policy: one log line, the job runs
    missing = f"{registry.host}/slurm/nothing:here"
    job = slurm.sbatch("-N1", f"--comment=x shoal:{missing} y", f"--chdir={work}", "--output=/dev/null", "--wrap=true")
    info = slurm.wait_job(job)
    assert info["JobState"] == "COMPLETED"
    (line,) = [ln for ln in (work / "prolog.log").read_text().splitlines() if f"job={job} " in ln]
    assert f"image={missing} state=cold rc=1" in line and "policy=continue" in line
    slurm.wait_idle()  # not drained
    # policy cancel: the job is cancelled, the node is not drained
    write_settings(work, node.root, SHOAL_PREFETCH_TIMEOUT="20", SHOAL_PREFETCH_POLICY="cancel")
    job = slurm.sbatch("-N1", f"--comment=shoal:{missing}", f"--chdir={work}", "--output=/dev/null", "--wrap=true")
    assert slurm.wait_job(job)["JobState"] == "CANCELLED"
    assert any(f"job={job} " in ln and "policy=cancel" in ln for ln in (work / "prolog.log").read_text().splitlines())
    slurm.wait_idle()


@pytest.mark.parametrize(("policy", "exit_status"), [("continue", 0), ("fail", 1)])
def test_prolog_slurmctld_hands_the_job_nodelist_to_shoal_and_keeps_its_policy(tmp_path, policy, exit_status):
    """Run as slurmctld would (its environment), against a region that does not answer:
    the call gets the job's hostlist, fails, and the policy decides the exit status."""
    (tmp_path / "prolog.conf").write_text(
        f"export PYTHONPATH={shlex.quote(str(REPO))}\nSHOAL={shlex.quote(SHOAL)}\nSHOAL_PREFETCH_TIMEOUT=5\n"
        f"SHOAL_REGION_URL=http://127.0.0.1:9\nSHOAL_PREFETCH_POLICY={policy}\n"
        f"SHOAL_PROLOG_LOG={shlex.quote(str(tmp_path / 'log'))}\n")
    env = {"SHOAL_PROLOG_CONFIG": str(tmp_path / "prolog.conf"), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "gpu[001-004]", "SLURM_JOB_COMMENT": "shoal:127.0.0.1:9/a/b:c"}
    proc = subprocess.run([str(REPO / "deploy/slurm/prolog-slurmctld.sh")], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == exit_status, proc.stderr
    (line,) = (tmp_path / "log").read_text().splitlines()
    assert "shoal-prolog-slurmctld job=7 nodes=gpu[001-004] image=127.0.0.1:9/a/b:c state=not-ready" in line
    assert f"policy={policy}" in line and "shoal prefetch:" in line
    # a malformed node list is a usage error (exit 2 of shoal), logged the same way
    env["SLURM_JOB_NODELIST"] = "gpu[001-"
    subprocess.run([str(REPO / "deploy/slurm/prolog-slurmctld.sh")], env=env, check=False, timeout=120)
    assert "rc=2" in (tmp_path / "log").read_text().splitlines()[-1]


def test_prolog_slurmctld_warms_the_jobs_nodes_through_the_region_before_the_job_starts(registry, tmp_path_factory):
    """The controller's hook for real: slurmctld runs deploy/slurm/prolog-slurmctld.sh once
    for a two-node job; it calls `shoal prefetch --region URL --nodelist "$SLURM_JOB_NODELIST"
    --wait`; the region hands the warm-up to the two registered `shoal node`s (n1 and n2,
    each with its own root and containerd). The job's batch script (on its first node, with
    both nodes' roots on this machine) measures both nodes before anything starts, then
    does the lazy start on each: nothing from the origin, and the origin served one copy."""
    reason = slurm_missing()
    if reason:
        pytest.skip(reason)
    import requests

    from snapshotter.embedded import stop_process
    from tests.services import shoal_node_with_containerd, start_region, wait_for

    _, ref, manifest = lazy_app_image(registry, tmp_path_factory.mktemp("slurm fleet image"), "slurm/fleet", CMD,
                                      salt="fleet")
    work = Path(tempfile.mkdtemp(prefix="shoal-slurmr-", dir="/tmp"))
    os.chmod(work, 0o755)
    region, url, ca = start_region(registry.url, work / "region", work / "region.log",
                                   config="[prefetch]\nnode_timeout = 10\n")
    tls = work / "region" / "tls"
    try:
        def node_config(name: str) -> str:
            return (f'[fetch]\nregion_url = "{url}"\nregion_ca = "{ca}"\nregion_token_file = "{tls / "node-token"}"\n'
                    f'[node]\nname = "{name}"\n')

        with shoal_node_with_containerd("shoal-sr1-", node_config("n1")) as n1, \
                shoal_node_with_containerd("shoal-sr2-", node_config("n2")) as n2:
            token = (tls / "prefetch-token").read_text().strip()

            def registered() -> bool:
                nodes = requests.get(f"{url}/prefetch/v1/nodes", headers={"X-Shoal-Prefetch-Token": token},
                                     verify=ca, timeout=10).json()["nodes"]
                return {n["name"] for n in nodes if n["state"] == "up"} >= {"n1", "n2"}

            wait_for(registered, "n1 and n2 registered with the region")
            wrapper = work / "prolog-slurmctld"
            wrapper.write_text(f"#!/bin/sh\nSHOAL_PROLOG_CONFIG={work}/prolog.conf exec "
                               f"{REPO / 'deploy/slurm/prolog-slurmctld.sh'}\n")
            wrapper.chmod(0o755)
            settings = {"SHOAL": SHOAL, "SHOAL_REGION_URL": url, "SHOAL_REGION_CA": ca,
                        "SHOAL_PREFETCH_TOKEN_FILE": str(tls / "prefetch-token"), "SHOAL_PREFETCH_MODE": "full",
                        "SHOAL_PREFETCH_TIMEOUT": "180", "SHOAL_PROLOG_LOG": str(work / "prolog.log")}
            (work / "prolog.conf").write_text(f"export PYTHONPATH={shlex.quote(str(REPO))}\n" + "".join(
                f"{k}={shlex.quote(v)}\n" for k, v in settings.items()))
            q = shlex.quote
            run = " ".join(q(a) for a in CMD)
            lines = ["#!/bin/sh", "set -e"]
            for name, (node, _) in (("n1", n1), ("n2", n2)):
                lines.append(f"{q(SHOAL)} prefetch {q(ref)} --root {q(str(node.root))} --mode full --node-name {name} "
                             f"--json > {q(str(work / f'warm-{name}.json'))}")
            lines.append(f"cp {q(str(registry.log_path))} {q(str(work / 'registry-start.log'))}")
            for name, (_, ctd) in (("n1", n1), ("n2", n2)):
                lines.append(f"{q(SHOAL)} pull {q(ref)} --address {q(ctd.address)} --namespace shoal-test --json "
                             f"> {q(str(work / f'pull-{name}.json'))}")
                lines.append(f"{CTR_BIN} --address {q(ctd.address)} --namespace shoal-test run --rm --snapshotter "
                             f"shoal {q(ref)} job-{name} {run} > {q(str(work / f'ctr-{name}.out'))}")
            lines.append('echo "step done on $SLURM_JOB_NODELIST"')
            step = work / "step.sh"
            step.write_text("\n".join(lines) + "\n")
            step.chmod(0o755)
            start = registry_log(registry.log_path)
            slurm = start_slurm(work / "slurm", ["n1", "n2"], extra=f"PrologSlurmctld={wrapper}")
            try:
                job = slurm.sbatch("-N2", f"--comment=shoal:{ref}", f"--chdir={work}", f"--output={work}/job.out",
                                   str(step))
                info = slurm.wait_job(job)
                out = (work / "job.out").read_text(errors="replace") if (work / "job.out").exists() else ""
                assert info["JobState"] == "COMPLETED", f"{info}\n{out}\n{slurm.logs()}"
            finally:
                slurm.stop()
            assert info["NodeList"] == "n[1-2]" and "step done on n[1-2]" in out
            (line,) = [ln for ln in (work / "prolog.log").read_text().splitlines() if f"job={job} " in ln]
            assert f"shoal-prolog-slurmctld job={job} nodes=n[1-2] image={ref} state=ready" in line
            assert "2 of 2 nodes warm" in line
            targets = []
            for name in ("n1", "n2"):  # warm before the job's script started: each node's own measure
                (n,) = json.loads((work / f"warm-{name}.json").read_text())["nodes"]
                assert n["state"] == "warm" and n["warm_bytes"] == n["target_bytes"] > 1_000_000, n
                targets.append(n["target_bytes"])
                assert [ly["kind"] for ly in json.loads((work / f"pull-{name}.json").read_text())["layers"]] == \
                    ["lazy"] * 3
                assert "changed by the top layer" in (work / f"ctr-{name}.out").read_text()
            before_step, end = registry_log(work / "registry-start.log"), registry_log(registry.log_path)
            assert layer_bytes(end[len(before_step):], manifest) == 0  # the starts read nothing from the origin
            served = layer_bytes(before_step[len(start):], manifest)
            assert targets[0] <= served <= 1.05 * targets[0]  # one origin copy for both nodes
    finally:
        stop_process(region)
        region.stdout.close()
        shutil.rmtree(work, ignore_errors=True)
