#!/usr/bin/env bash
# The device image has no internet: install packages from wheels carried in .wheels/ (downloaded here from the
# package registry; see benchmarks/README.md). Usage: source benchmarks/gpu_wheels.sh PACKAGE...
for pkg in "$@"; do
  python3 -m pip install -q --break-system-packages --no-index --find-links .wheels "$pkg" 2>&1 | grep -v "^WARNING" | tail -3
  python3 -c "import importlib, sys; importlib.import_module(sys.argv[1].replace('-', '_'))" "$pkg" \
    && echo "installed $pkg" || echo "could not install $pkg"
done
