#!/usr/bin/env bash
# Install into .venv only what the demo needs (the project, torch CPU, the MiniLM reward model)
# and run it on the local backend: tangram-hpc demo [ARGS].  scripts/test.sh installs the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-env.sh --demo
exec .venv/bin/tangram-hpc demo "$@"
