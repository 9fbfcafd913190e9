#!/usr/bin/env bash
# Install into .venv and run the demo on the local backend: tangram-hpc demo [ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_MODEL=${WITH_MODEL:-1} scripts/setup-env.sh
exec .venv/bin/tangram-hpc demo "$@"
