#!/usr/bin/env bash
# The whole test suite, from a clean clone: installs what it needs, starts the loopback
# Slurm cluster, runs pytest.  Extra arguments go to pytest (e.g. scripts/test.sh -m "not slurm").
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_MODEL=1 scripts/setup-env.sh --languages
if [ -x scripts/dev-cluster.sh ]; then
    scripts/dev-cluster.sh start
fi
export TANGRAM_REQUIRE_ALL=1   # tests whose prerequisites are missing fail instead of skipping

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

exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
