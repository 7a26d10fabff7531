#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels (.wheels/, see benchmarks/gpu_wheels.sh), run
# run.py with the given arguments, and pack its logs into one file (the device returns at most 8 files).
#   bash benchmarks/hybrid27b/device.sh --runs gpu,int4            (then --reuse-build --runs capped on the warm machine)
# The wheels, downloaded here (the device has Python 3.12 and no registry):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform any -d .wheels typer click shellingham rich markdown-it-py mdurl \
#     pygments compressed-tensors pydantic pydantic-core annotated-types typing-inspection loguru gguf frozendict \
#     typing-extensions psutil requests urllib3 certifi charset-normalizer idna annotated-doc
set -uo pipefail
OUT=${OUT:?set OUT to a results directory}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
source benchmarks/gpu_wheels.sh typer rich compressed-tensors gguf
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h /dev/shm /tmp / | tail -n +2
free -g | head -2
R="$OUT/r"
mkdir -p "$R"
timeout "${H27_LIMIT:-585}" python3 benchmarks/hybrid27b/run.py "$@" --out "$R"
rc=$?
cp "$R/hybrid27b.json" "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$R" .
rm -rf "$R"
exit $rc
