#!/bin/sh
# shoal's PrologSlurmctld: warm every node of a job through the region's preheat API,
# once per job, on the controller (the region fetches each byte from the origin once and
# the nodes share it through the swarm).
#
#     PrologSlurmctld=/usr/lib/shoal/slurm/prolog-slurmctld.sh
#     sbatch --comment="shoal:HOST/REPO:TAG" -N 512 job.sh
#
# It runs `shoal prefetch REF --region URL --nodelist "$SLURM_JOB_NODELIST" --wait`: the
# job stays CONFIGURING (its nodes allocated, nothing started) until the region says the
# nodes are warm or the timeout passes, so the job is held until warm, at most
# SHOAL_PREFETCH_TIMEOUT seconds. The same settings file as prolog.sh, with
# SHOAL_REGION_URL, SHOAL_PREFETCH_TOKEN_FILE (a copy of the region's
# STORE/tls/prefetch-token, root's alone), SHOAL_REGION_CA (the region's ca.pem) and
# SHOAL_PREFETCH_READY (the fraction of nodes that must be warm). Policies:
#   continue  (default) exit 0 whatever happened: the job starts, nodes warm lazily
#   fail      exit 1: Slurm requeues the job (a batch job) to run later; no node is drained
. "$(dirname "$0")/prolog-common.sh"
nodes=${SLURM_JOB_NODELIST:-}
[ -n "$image" ] || exit 0
if [ -z "$SHOAL_REGION_URL" ]; then
    log shoal-prolog-slurmctld "nodes=$nodes image=$image no SHOAL_REGION_URL set: not warmed"
    exit 0
fi

export SHOAL_PREFETCH_TOKEN_FILE SHOAL_REGION_CA  # read by shoal prefetch (never on its command line)
case $SHOAL_REGION_URL in
    http://*) plain=--plain-http ;;  # (a loopback region: shoal refuses any other in clear)
    *) plain= ;;
esac
# shellcheck disable=SC2086
run_prefetch --region "$SHOAL_REGION_URL" --nodelist "$nodes" --ready "$SHOAL_PREFETCH_READY" $plain
if [ "$rc" -eq 0 ]; then
    log shoal-prolog-slurmctld "nodes=$nodes image=$image state=ready seconds=$took: $summary"
    exit 0
fi
log shoal-prolog-slurmctld "nodes=$nodes image=$image state=not-ready rc=$rc seconds=$took policy=$SHOAL_PREFETCH_POLICY: $summary"
[ "$SHOAL_PREFETCH_POLICY" = fail ] && exit 1
exit 0
