#!/usr/bin/env bash
# Put torch into the environment of $1 (a python) without pulling a multi-GB CUDA build where
# there is no GPU:
#   - a torch already importable there is kept (your own build);
#   - MESHRUN_TORCH_SPEC, if set, is installed as given (e.g. "torch==2.13.0+cu128");
#   - with an NVIDIA driver (nvidia-smi), pip's default build for this platform (CUDA on Linux);
#   - otherwise the CPU wheel: from pip's configured sources if they have it (a local wheel
#     directory), else from PyTorch's CPU index.
set -euo pipefail
python=${1:?usage: install-torch.sh PYTHON}
cpu_version=2.13.0

if "$python" -c "import torch" 2>/dev/null; then
  echo "torch $("$python" -c 'import torch; print(torch.__version__)') already installed: kept"
elif [ -n "${MESHRUN_TORCH_SPEC:-}" ]; then
  "$python" -m pip install "$MESHRUN_TORCH_SPEC"
elif command -v nvidia-smi >/dev/null 2>&1; then
  "$python" -m pip install "torch>=2.6"
else
  "$python" -m pip install "torch==${cpu_version}+cpu" 2>/dev/null \
    || "$python" -m pip install "torch==${cpu_version}+cpu" \
         --index-url https://download.pytorch.org/whl/cpu \
         --extra-index-url https://pypi.org/simple
fi
