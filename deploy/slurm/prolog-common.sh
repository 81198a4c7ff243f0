# Sourced by prolog.sh and prolog-slurmctld.sh (not run by itself): settings, the log,
# the job's image. Sets SHOAL*, job, image (empty: not a shoal job), run_prefetch, log.
set -u
set -f  # the comment's words are not globbed
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}  # slurmd's Prolog environment is bare

config=${SHOAL_PROLOG_CONFIG:-/etc/shoal/slurm-prolog.conf}
# shellcheck disable=SC1090
[ -r "$config" ] && . "$config"

SHOAL=${SHOAL:-/usr/local/bin/shoal}
SHOAL_ROOT=${SHOAL_ROOT:-/var/lib/shoal}
SHOAL_REGION_URL=${SHOAL_REGION_URL:-}
SHOAL_PREFETCH_MODE=${SHOAL_PREFETCH_MODE:-profile}
SHOAL_PREFETCH_TIMEOUT=${SHOAL_PREFETCH_TIMEOUT:-300}
SHOAL_PREFETCH_READY=${SHOAL_PREFETCH_READY:-1.0}
SHOAL_PREFETCH_TOKEN_FILE=${SHOAL_PREFETCH_TOKEN_FILE:-/etc/shoal/prefetch-token}
SHOAL_REGION_CA=${SHOAL_REGION_CA:-}
SHOAL_PREFETCH_POLICY=${SHOAL_PREFETCH_POLICY:-continue}
SHOAL_PROLOG_LOG=${SHOAL_PROLOG_LOG:-/var/log/shoal/slurm-prolog.log}
SCANCEL=${SCANCEL:-scancel}
job=${SLURM_JOB_ID:-?}

# log WHO TEXT...: one line in SHOAL_PROLOG_LOG
log() {
    who=$1; shift
    mkdir -p "$(dirname "$SHOAL_PROLOG_LOG")" 2>/dev/null
    printf '%s %s job=%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$who" "$job" "$*" >>"$SHOAL_PROLOG_LOG" 2>/dev/null
}

# The image: the first word "shoal:REF" of the job's comment (sbatch --comment).
image=
for word in ${SLURM_JOB_COMMENT:-}; do
    case $word in
        shoal:?*) image=${word#shoal:}; break ;;
    esac
done

# run_prefetch ARGS...: shoal prefetch IMAGE ARGS --wait; sets rc, took (seconds) and
# summary (its output on one line). `timeout` bounds the whole call (registry look-ups
# included) a little past shoal's own --timeout, so the prolog ends before Slurm's
# PrologEpilogTimeout kills it.
run_prefetch() {
    start=$(date +%s)
    out=$(timeout -k 5 $((SHOAL_PREFETCH_TIMEOUT + 30)) "$SHOAL" prefetch "$image" "$@" \
          --mode "$SHOAL_PREFETCH_MODE" --wait --timeout "$SHOAL_PREFETCH_TIMEOUT" 2>&1)
    rc=$?
    took=$(( $(date +%s) - start ))
    summary=$(printf '%s' "$out" | tr '\n' ' ')
}
