#!/usr/bin/env bash
# The whole test suite, from a clean clone: installs what it needs, starts the loopback
# Slurm cluster, checks lint and types, runs pytest on the Python sources, then the policy and
# simulator tests again compiled.  Extra arguments go to pytest (e.g. scripts/test.sh -m "not slurm").
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_MODEL=1 scripts/setup-env.sh --languages
if [ -x scripts/dev-cluster.sh ]; then
    scripts/dev-cluster.sh start
fi
export TANGRAM_REQUIRE_ALL=1   # tests whose prerequisites are missing fail instead of skipping
unset TANGRAM_NATIVE

# Lint and types first (pinned in the test extras; configured in pyproject.toml).
.venv/bin/python -m ruff check tangram_hpc tests benchmarks
.venv/bin/python -m mypy
# The compiled build must exist for the second run below: no build is a failure here, not a skip.
.venv/bin/python -m tangram_hpc.cli native build

# The fresh-machine case, wherever this runs: while the tests run, `python3` and `python` on PATH
# are the system interpreter without any site-packages (-S), so a template, script or job that
# relies on packages installed outside .venv fails here as it would on a new machine.
system_python=$(command -v python3 >/dev/null && python3 -c 'import sys; print(sys.executable)')
bare=$PWD/.venv/bare-python
rm -rf "$bare" && mkdir -p "$bare"
for name in python3 python; do
    printf '#!/bin/sh\nexec %s -S "$@"\n' "$system_python" >"$bare/$name"
    chmod +x "$bare/$name"
done
export PATH="$bare:$PATH" PYTHONNOUSERSITE=1 TANGRAM_BARE_PYTHON="$bare/python3"

# Every process runs the Python sources (the build is opt-in, for bench and the simulator) ...
.venv/bin/python -m pytest -q -p no:cacheprovider --ignore=tests/test_native.py "$@"
# ... and the policies, the simulator and the ledger that drives the policies run compiled too,
# with the tests of the build itself (docs/architecture.md, "The native build").  Not the live
# fidelity runs (two minutes): their live half runs the Python sources whatever this sets (the live
# commands refuse the build), and the compiled simulator's figures are the Python ones bit for bit
# (test_native.py's bench comparison).
TANGRAM_NATIVE=1 exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_native.py \
    tests/test_sched_policies.py tests/test_sched_predict_pool.py tests/test_sched_sim.py tests/test_sched_workload.py \
    tests/test_ledger.py tests/test_env_fencing.py \
    --deselect tests/test_sched_sim.py::test_fidelity_live_and_simulated_act_agree_within_15_percent "$@"
