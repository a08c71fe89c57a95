#!/usr/bin/env bash
# Put torch into the environment of $1 (a python) without pulling a multi-GB CUDA build where
# there is no GPU:
#   - a torch already importable there is kept (your own build);
#   - MESHRUN_TORCH_SPEC, if set, is installed as given (e.g. "torch==2.13.0+cu128");
#   - with an NVIDIA driver (nvidia-smi), pip's default build for this platform (CUDA on Linux);
#   - otherwise the CPU wheel: from pip's configured sources if they have it (a local wheel
#     directory), else from PyTorch's CPU index.
# With uv beside the python (make install puts it there) uv installs, pip otherwise: unpacking
# the CPU wheel takes pip 33 s on 2 cores, uv 3 s (and 20 s more to compile its bytecode,
# which pip also does: where PYTHONDONTWRITEBYTECODE is set, as on CI, every process
# would otherwise compile torch anew on import, which doubled the test suite's time).
set -euo pipefail
python=${1:?usage: install-torch.sh PYTHON}
cpu_version=2.13.0
uv="$(dirname "$python")/uv"

install() {
  if [ -x "$uv" ]; then
    # uv reads no pip config: hand it pip's local wheel directory, if there is one
    local links=${PIP_FIND_LINKS:-$("$python" -m pip config get global.find-links 2>/dev/null || true)}
    "$uv" pip install --quiet --compile-bytecode --python "$python" \
      ${links:+--find-links "$links"} "$@"
  else
    "$python" -m pip install "$@"
  fi
}

if "$python" -c "import torch" 2>/dev/null; then
  echo "torch $("$python" -c 'import torch; print(torch.__version__)') already installed: kept"
elif [ -n "${MESHRUN_TORCH_SPEC:-}" ]; then
  install "$MESHRUN_TORCH_SPEC"
elif command -v nvidia-smi >/dev/null 2>&1; then
  install "torch>=2.11"
else
  install "torch==${cpu_version}+cpu" 2>/dev/null \
    || install "torch==${cpu_version}+cpu" \
         --index-url https://download.pytorch.org/whl/cpu \
         --extra-index-url https://pypi.org/simple
fi
