#!/usr/bin/env bash
# Submit a tangram-hpc coordinator with sbatch and wait until it is reachable.
#
#   scripts/launch-coordinator.sh [--shared DIR] [--config FILE] [--partition P] [--gpu-partition P]
#                                 [--max-workers N] [--time MIN] [--wait SEC] [-- extra sbatch options]
#
# Prints the coordinator's job id and connection file path once the connection file
# exists (exit 1 if the job ends or --wait passes first).  --config names a tangram-hpc
# TOML configuration file (every setting; `tangram-hpc config show --config FILE` prints
# what it amounts to); the other options set the variables slurm_templates/coordinator.sbatch
# documents: --partition/--gpu-partition and --time (minutes) are the *worker* jobs'; the
# coordinator job's own sbatch options (its --time, --partition, --account) go after --.
# Clients then use:
#   Client.from_connection_file("<printed path>")   (or $TANGRAM_CONNECTION_FILE)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHARED=${TANGRAM_SHARED:-$PWD/tangram-shared}
WAIT=120
while (($#)); do
    case $1 in
        --shared) SHARED=$2; shift 2 ;;
        --config) TANGRAM_CONFIG=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); export TANGRAM_CONFIG; shift 2 ;;
        --partition) export TANGRAM_PARTITION=$2; shift 2 ;;
        --gpu-partition) export TANGRAM_GPU_PARTITION=$2; shift 2 ;;
        --max-workers) export TANGRAM_MAX_WORKERS=$2; shift 2 ;;
        --time) export TANGRAM_WORKER_TIME=$2; shift 2 ;;
        --wait) WAIT=$2; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
SHARED=$(mkdir -p "$SHARED" && cd "$SHARED" && pwd)
export TANGRAM_SHARED=$SHARED
CONN=${TANGRAM_CONNECTION_FILE:-$SHARED/coordinator.json}
export TANGRAM_CONNECTION_FILE=$CONN
if [[ -s $CONN ]]; then
    # a coordinator still running with this file: writing over it would cut its clients and workers off
    old_job=$(sed -n 's/.*"slurm_job_id": *"\([0-9_]*\)".*/\1/p' "$CONN")
    old_state=$([[ -n $old_job ]] && squeue -h -j "$old_job" -o %T 2>/dev/null || true)
    if [[ -n $old_state ]]; then
        echo "a coordinator (job $old_job, $old_state) runs with $CONN; stop it (scancel $old_job) or launch" \
             "with another --shared directory or TANGRAM_CONNECTION_FILE" >&2
        exit 1
    fi
fi
rm -f "$CONN"   # a file from an earlier run would look like success
# the job must import tangram_hpc even when it is not installed
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
# the python scripts/setup-env.sh installed into, unless the caller chose one
if [[ -z ${TANGRAM_PYTHON:-} && -x $HERE/.venv/bin/python ]]; then export TANGRAM_PYTHON=$HERE/.venv/bin/python; fi
job=$(sbatch --parsable --chdir "$SHARED" --export=ALL "$@" "$HERE/slurm_templates/coordinator.sbatch")
job=${job%%;*}
deadline=$((SECONDS + WAIT))
until [[ -s $CONN ]]; do
    state=$(squeue -h -j "$job" -o %T 2>/dev/null || true)
    case $state in
        ""|COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|PREEMPTED|OUT_OF_MEMORY)
            out=$SHARED/tangram-coordinator-$job.out
            echo "coordinator job $job ended (${state:-gone}) before writing $CONN; the end of $out:" >&2
            tail -n 5 "$out" 2>/dev/null | sed 's/^/  /' >&2
            exit 1 ;;
    esac
    if ((SECONDS >= deadline)); then
        echo "coordinator job $job ($state) wrote no connection file within ${WAIT}s" >&2; exit 1
    fi
    sleep 0.5
done
echo "job $job"
echo "connection $CONN"
