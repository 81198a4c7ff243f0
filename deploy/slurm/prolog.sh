#!/bin/sh
# shoal's per-node Slurm Prolog: warm this node for the job's image before the job starts.
#
# slurmd runs it (as root) on each node of a job before the job's first step there
# (PrologFlags=Alloc: at allocation). The job names its image in its comment:
#
#     sbatch --comment="shoal:HOST/REPO:TAG" job.sh     (other words in the comment are ignored)
#
# (Slurm 22.05 hands a Prolog SLURM_JOB_COMMENT and SLURMD_NODENAME, not the job's own
# environment, so the comment is the convention.) It runs
# `shoal prefetch REF --root ROOT --wait --timeout S`, which returns once the node has the
# image's TOCs loaded and its access profile's chunks (or, with mode full, its whole lazy
# layers) in the node's chunk store, as the node measures it.
#
# Policy when the node is not warm in time (or the prefetch fails), SHOAL_PREFETCH_POLICY:
#   continue  (default) log one line and exit 0: the job starts, its reads fetch lazily;
#             a slow preheat never fails a job or drains a node
#   cancel    log, `scancel` the job and exit 0 (the node is not drained)
#   fail      exit 1: Slurm's own Prolog failure path (the node is DRAINED and the job
#             requeued held, unless SchedulerParameters=nohold_on_prolog_fail)
#
# Settings: the shell file ${SHOAL_PROLOG_CONFIG:-/etc/shoal/slurm-prolog.conf}, if it
# exists (see slurm-prolog.conf in this folder). Each line it logs goes to SHOAL_PROLOG_LOG.
# prolog-common.sh must sit next to it.
. "$(dirname "$0")/prolog-common.sh"
node=${SLURMD_NODENAME:-$(uname -n)}
[ -n "$image" ] || exit 0  # not a shoal job

case $SHOAL_PREFETCH_POLICY in
    continue|cancel|fail) ;;
    *) log shoal-prolog "node=$node image=$image unknown SHOAL_PREFETCH_POLICY=$SHOAL_PREFETCH_POLICY: using continue"
       SHOAL_PREFETCH_POLICY=continue ;;
esac

run_prefetch --root "$SHOAL_ROOT" --node-name "$node"
if [ "$rc" -eq 0 ]; then
    log shoal-prolog "node=$node image=$image state=warm seconds=$took: $summary"
    exit 0
fi
log shoal-prolog "node=$node image=$image state=cold rc=$rc seconds=$took policy=$SHOAL_PREFETCH_POLICY: $summary"
case $SHOAL_PREFETCH_POLICY in
    cancel) "$SCANCEL" "$job" >/dev/null 2>&1 || log shoal-prolog "node=$node image=$image scancel $job failed"; exit 0 ;;
    fail) exit 1 ;;
esac
exit 0
