#!/usr/bin/env bash
# The whole test suite, from a clean clone: installs what it needs, starts the loopback
# Slurm cluster, runs pytest.  Extra arguments go to pytest (e.g. scripts/test.sh -m "not slurm").
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_MODEL=1 scripts/setup-env.sh
if [ -x scripts/dev-cluster.sh ]; then
    scripts/dev-cluster.sh start
fi
export TANGRAM_REQUIRE_ALL=1   # tests whose prerequisites are missing fail instead of skipping
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
