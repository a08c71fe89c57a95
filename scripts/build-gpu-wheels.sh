#!/usr/bin/env bash
# The wheels an offline GPU image needs beyond its own packages, built here where PyPI is
# reachable, carried with the tree and installed there by scripts/gpu-check.sh
# (docs/development.md, "An offline GPU node", has the whole procedure):
#
#   scripts/build-gpu-wheels.sh [DIR]        # -> DIR (outputs/gpu-wheels, ignored by git)
#
# scripts/gpu_wheels.py resolves meshrun's needs (its dependencies, the hf, ft and float8
# extras, pytest) for the image's CPython 3.12 against the versions its description gives
# (../shared/gpu-node-image.md) and keeps only what the image lacks or has too old: never
# torch, triton, nvidia-* or cuda-*. It prints which packages it assumed the image has at a
# version that satisfies, and fails (exit 1, the largest wheels named) when the set and the
# tree pass 60 MiB of the device tool's 64. GPU_PYTHON_VERSION picks another CPython.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
uv=$(command -v uv || echo .venv/bin/uv)
[ -x "$uv" ] || { echo "$0: needs uv (make install puts it in .venv)" >&2; exit 1; }
exec "$py" scripts/gpu_wheels.py --uv "$uv" "$@"
