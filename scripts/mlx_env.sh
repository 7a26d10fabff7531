#!/usr/bin/env bash
# Build an MLX environment (mlx[cpu] installs on Linux) kept apart from the main .venv, and run the tests
# marked `mlx`: our MLX export read back by mlx itself. Optional: dflash-mlx (MLX_DFLASH=1) for its loader.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${MLX_VENV:-.venv-mlx}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import mlx.core, dflash_quant" 2>/dev/null; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "torch==2.13.0" || "$VENV/bin/pip" install -q "torch>=2.13,<2.15"
    "$VENV/bin/pip" install -q "mlx[cpu]==0.32.*" "mlx-lm==0.32.*"
    if [ "${MLX_DFLASH:-0}" = 1 ]; then "$VENV/bin/pip" install -q "dflash-mlx==0.1.8"; fi
    "$VENV/bin/pip" install -q -e ".[test]"
fi
"$VENV/bin/python" -c "import mlx.core as mx; print('mlx', mx.__version__)"
exec "$VENV/bin/python" -m pytest -m mlx tests/test_export_mlx.py -q -p no:cacheprovider "$@"
