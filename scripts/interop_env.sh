#!/usr/bin/env bash
# Build .venv-interop (GPTQModel + torch>=2.14.1, kept apart from the main .venv) and run the interop tests.
# GPTQModel 7.7.0 ships only an sdist, but it is pure Python (its kernels JIT-compile on first use),
# so a plain pip install works on a CPU box. torch 2.14.1 is the CUDA build; it imports fine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
VENV=${INTEROP_VENV:-.venv-interop}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import gptqmodel" 2>/dev/null; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "torch==2.14.1"
    "$VENV/bin/pip" install -q "gptqmodel==7.7.0" "torch==2.14.1"
    # Our package without re-resolving torch; its own light deps come next.
    "$VENV/bin/pip" install -q --no-deps -e .
    "$VENV/bin/pip" install -q "safetensors>=0.4" "typer>=0.15" "rich>=13" "huggingface_hub>=1.0" \
        "compressed-tensors>=0.12" "matplotlib>=3.8" "pytest>=8"
fi
"$VENV/bin/python" -c "import torch, gptqmodel; print('torch', torch.__version__, 'gptqmodel', gptqmodel.__version__)"
exec "$VENV/bin/python" -m pytest -m interop tests/interop -q -p no:cacheprovider "$@"
