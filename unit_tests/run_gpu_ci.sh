#!/usr/bin/env bash
# Run the WHOLE test suite (slow and CUDA-only tests included) on a CUDA machine.
#
#   unit_tests/run_gpu_ci.sh [OUT_DIR] [PYTEST_ARGS...]
#
# GPU_CI_PATHS: test paths (default: unit_tests). GPU_CI_WORKERS: pytest-xdist workers
# (default 8, 0 = none; used only where xdist is installed). GPU_CI_TEST_TIMEOUT_S: per test.
# OUT_DIR: the first argument unless it starts with '-', else $OUT, else ./gpu_ci_out.
# Writes there:
#   junit.xml     pytest's JUnit XML
#   summary.txt   one line: passed=N failed=N skipped=N errors=N total=N time=Ts
#   failed.txt    FAILED / ERROR <test>, one per line (empty when all passed)
#   failed_live.txt  <phase> <test> of each failure as it happens (kept when a time limit cuts the run)
#   pytest.log    pytest's full output
#   env.txt       GPU, driver, torch / triton / transformers versions
# Exits with pytest's status. Without CUDA it refuses (exit 2) unless GPU_CI_ALLOW_CPU=1.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -gt 0 && "$1" != -* ]]; then
    OUT_DIR="$1"
    shift
else
    OUT_DIR="${OUT:-gpu_ci_out}"
fi
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PYTHON="${PYTHON:-python}"
cd "$REPO"

# Compiled Triton kernels, not the interpreter (conftest.py sets it only without CUDA)
unset TRITON_INTERPRET

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) changed files"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: unavailable"
    "$PYTHON" - <<'EOF'
import importlib
import torch
print("python", __import__("sys").version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("triton", "transformers", "fastapi", "uvicorn"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "MISSING")
EOF
} > "$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [[ "${GPU_CI_ALLOW_CPU:-0}" != "1" ]]; then
        echo "run_gpu_ci.sh: no CUDA device (set GPU_CI_ALLOW_CPU=1 to run anyway)" >&2
        exit 2
    fi
    echo "run_gpu_ci.sh: WARNING: no CUDA device, running on CPU (GPU_CI_ALLOW_CPU=1)" >&2
fi

# Parallel workers (pytest-xdist, one file per worker at a time, but the tests of files marked
# ``spread`` one by one: conftest.py) and a per-test time limit
# (pytest-timeout) where installed: most of the suite waits on subprocesses and servers.
EXTRA=(--durations=30)
if "$PYTHON" -c "import xdist" 2>/dev/null && [[ "${GPU_CI_WORKERS:-8}" != "0" ]]; then
    EXTRA+=(-n "${GPU_CI_WORKERS:-8}" --dist loadgroup)
    export LIGHTLLM_CPU_THREADS="${LIGHTLLM_CPU_THREADS:-2}"
fi
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then
    EXTRA+=(--timeout "${GPU_CI_TEST_TIMEOUT_S:-600}")
fi

: > "$OUT_DIR/failed_live.txt"
export LIGHTLLM_FAILED_LIVE="$OUT_DIR/failed_live.txt"
# -m "": no marker filter, so slow and cuda tests run too
"$PYTHON" -m pytest ${GPU_CI_PATHS:-unit_tests} -m "" -rfEs "${EXTRA[@]}" --junitxml="$OUT_DIR/junit.xml" "$@" 2>&1 | tee "$OUT_DIR/pytest.log"
status=${PIPESTATUS[0]}

if [[ -f "$OUT_DIR/junit.xml" ]]; then
    "$PYTHON" unit_tests/gpu_ci_summary.py "$OUT_DIR/junit.xml" \
        --summary "$OUT_DIR/summary.txt" --failed "$OUT_DIR/failed.txt"
else
    echo "no junit.xml: pytest exited with $status before writing it" | tee "$OUT_DIR/summary.txt"
    : > "$OUT_DIR/failed.txt"
fi
echo "pytest exit status: $status"
exit "$status"
