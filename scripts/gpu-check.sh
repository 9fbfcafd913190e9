#!/usr/bin/env bash
# The GPU check of the reward-model services (issue 36), for one short run on a bare GPU machine:
# Python 3 with torch (CUDA), msgpack, psutil, pytest, aiohttp and sentence-transformers, no
# network, nothing of this project installed.  Run from the repository root with .gpu-carry/
# (made by scripts/gpu-carry.sh) carried beside the working tree:
#   scripts/gpu-check.sh            H200-sized services (about 3 minutes)
#   scripts/gpu-check.sh --cpu      the CPU stand-in's small sizes (to try this script anywhere)
# Writes $OUT/gpu.log, $OUT/gpu.json and $OUT/costs.json (the measured load costs, for
# `tangram-hpc bench --service-costs`; $OUT: a new temporary directory when unset), then prints the
# figures and the done-when checks.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
SITE=${GPU_CHECK_SITE:-/tmp/site}
mkdir -p "$OUT"
LOG=$OUT/gpu.log

if [ "${1:-}" = --cpu ]; then
    SIZES=(--device cpu)
    TEST_DEVICE=cpu
else
    # Host RAM bounds the sizes (128 GB on the H200 machine: every service has its host copy).
    SIZES=(--device cuda --sizes-gb 1,4,16 --rotation-gb 8,8,12,12 --budget-gb 30 --copy-gb 4
           --small-gb 0.25 --cluster-gb 6 --rounds 2 --cluster-calls 12 --prefetch-busy-inputs 131072)
    TEST_DEVICE=cuda
fi

{
    echo "== $(date -u +%FT%TZ) $(uname -n)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
    # Wheels for what the machine lacks (pyzmq, submitit, cloudpickle); an interpreter that is not
    # 3.12 refuses them and keeps what it has.
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .gpu-carry/*.whl \
        || echo "wheels not installed; using the interpreter's own packages"
    export PYTHONPATH="$SITE:$PWD" TANGRAM_NATIVE=0 TANGRAM_MINILM_DIR="$PWD/.gpu-carry/minilm" \
        HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TANGRAM_TEST_DEVICE=$TEST_DEVICE
    "$PY" -c 'import sys, torch, zmq, submitit, msgpack
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.cuda.is_available()}, zmq {zmq.__version__}")' \
        || exit 1
    echo "== tests (device: $TEST_DEVICE)"
    timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_services.py tests/test_services_config.py \
        tests/test_services_memory.py tests/test_services_minilm.py 2>&1 | tail -15
    echo "== benchmarks/gpu_services.py ${SIZES[*]}"
    timeout 330 "$PY" benchmarks/gpu_services.py "${SIZES[@]}" --json "$OUT/gpu.json" --costs "$OUT/costs.json"
    echo "benchmark exit status $?"
} 2>&1 | tee "$LOG"

[ -f "$OUT/gpu.json" ] || { echo "no $OUT/gpu.json"; exit 1; }
"$PY" - "$OUT/gpu.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"== figures ({r['device']}, {r.get('gpu') or 'no GPU'}, {r.get('total_s', 0):.0f} s)")
bw = r.get("bandwidth", {})
print("copy GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items() if isinstance(v, float)))
for row in r.get("load_evict") or []:
    if isinstance(row, dict) and "size_gb" in row:
        print(f"service {row['size_gb']:.2f} GB: load {row['load_s']:.3f} s ({row['load_gbps']:.1f} GB/s, "
              f"{row['load_ratio_to_pinned']:.2f}x pinned), evict {row['evict_s'] * 1e3:.1f} ms, {row['host_memory']}")
rot = r.get("rotation", {})
print(f"rotation: {json.dumps(rot)}")
for key in ("prefetch", "prefetch_coordinator", "batching", "minilm", "coordinator"):
    print(f"{key}: {json.dumps(r.get(key))}")
print("checks: " + ", ".join(f"{k}={v}" for k, v in r.get("checks", {}).items()))
EOF
echo "log: $LOG  figures: $OUT/gpu.json"
