#!/usr/bin/env bash
# The fault suite, N times (default 10), with a CPU hog on every core beside it:
#
#   scripts/fault-runs.sh [N] [pytest arguments...]
#
# Each run is one pytest of the fault tests: the stateful-environment scenarios of
# tests/test_env_faults.py (worker SIGKILL, SIGSTOP, scancel, drain at the time limit, coordinator
# stopped and restarted, coordinator killed and restarted; every action appends its id to its
# environment's log.txt, read back from the environments' files at the end), a node lost on the
# multi-node cluster (tests/test_node_loss.py, the same check), tests/test_faults.py,
# tests/test_fault_injection.py and the coordinator restarts of tests/test_env_restart.py.  It prints,
# per run and in total: the scenarios' actions, those ok, lines lost and lines duplicated in the
# environments, and the tests passed and failed.  Exit status 0 only when every run passed with no
# line lost or duplicated.  Needs the loopback Slurm cluster (scripts/dev-cluster.sh start).
#
# PYTHON names the interpreter (default .venv/bin/python; the Slurm jobs run it too, as TANGRAM_PYTHON);
# FAULT_RUNS_HOG=0 runs without the hog.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10}
[[ $runs =~ ^[0-9]+$ ]] || { echo "usage: $0 [N] [pytest arguments...]" >&2; exit 2; }
shift || true
python=${PYTHON:-.venv/bin/python}
[[ $python == */* ]] && python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
export TANGRAM_PYTHON=${TANGRAM_PYTHON:-$python}
tests=(tests/test_env_faults.py tests/test_node_loss.py tests/test_faults.py tests/test_fault_injection.py
       tests/test_env_restart.py)
work=$(mktemp -d -t tangram-fault-runs.XXXXXX)

hogs=()
stop_hogs() { local p; for p in "${hogs[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop_hogs EXIT
if [[ ${FAULT_RUNS_HOG:-1} != 0 ]]; then
    for ((c = 0; c < $(nproc); c++)); do
        (while :; do :; done) &
        hogs+=($!)
    done
fi
echo "fault-runs: $runs runs of ${tests[*]}; hog: ${#hogs[@]} busy loops; logs in $work"

for ((i = 1; i <= runs; i++)); do
    start=$SECONDS
    rc=0
    TANGRAM_FAULT_COUNTS=$work/run$i.jsonl "$python" -m pytest -q -p no:cacheprovider "${tests[@]}" "$@" \
        >"$work/run$i.log" 2>&1 || rc=$?
    touch "$work/run$i.jsonl"
    summary=$({ grep -E '^(=+ )?[0-9]+ (passed|failed)|no tests ran' "$work/run$i.log" || true; } | tail -1 | tr -d '=' | sed 's/^ *//')
    "$python" - "$work/run$i.jsonl" "$i" "$rc" "$((SECONDS - start))" "$summary" <<'PY'
import json, sys
path, run, rc, secs, summary = sys.argv[1:]
rows = [json.loads(line) for line in open(path) if line.strip()]
tot = {k: sum(r[k] for r in rows) for k in ("actions", "ok", "lost", "duplicated", "envs_lost")}
print(f"run {run}: actions {tot['actions']} (ok {tot['ok']}), lines lost {tot['lost']}, duplicated "
      f"{tot['duplicated']}, environments lost {tot['envs_lost']}; pytest: {summary or 'no summary'} "
      f"(rc {rc}, {secs}s)", flush=True)
for r in rows:
    if r["lost"] or r["duplicated"] or r["envs_lost"] or r["ok"] != r["actions"]:
        print(f"    {r['fault']}: {r['ok']}/{r['actions']} ok, lost {r['lost']}, duplicated {r['duplicated']}: "
              f"{' '.join(r['notes'])[:2000]}", flush=True)
PY
    [[ $rc == 0 ]] || grep -E '^(FAILED|ERROR) ' "$work/run$i.log" | sed 's/^/    /' || true
    echo "$rc" >"$work/run$i.rc"
done

"$python" - "$work" "$runs" <<'PY'
import json, pathlib, sys
work, runs = pathlib.Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(line) for i in range(1, runs + 1) for line in open(work / f"run{i}.jsonl") if line.strip()]
failed = sum((work / f"run{i}.rc").read_text().strip() != "0" for i in range(1, runs + 1))
tot = {k: sum(r[k] for r in rows) for k in ("actions", "ok", "lost", "duplicated", "envs_lost")}
print(f"total over {runs} runs: {len(rows)} scenarios, actions {tot['actions']} (ok {tot['ok']}), lines lost "
      f"{tot['lost']}, duplicated {tot['duplicated']}, environments lost {tot['envs_lost']}; runs with a "
      f"failed test: {failed}")
sys.exit(1 if failed or tot["lost"] or tot["duplicated"] or tot["envs_lost"] else 0)
PY
