#!/usr/bin/env bash
# Put torch into the environment of $1 (a python): a build that sees this host's GPUs where it
# has any, without pulling a multi-GB CUDA build where there is none:
#   - MESHRUN_TORCH_SPEC, if set, is installed as given, over any torch there: pip's arguments,
#     e.g. "torch==2.13.0+cu126 --index-url https://download.pytorch.org/whl/cu126";
#   - with an NVIDIA driver (nvidia-smi lists GPUs): a CUDA torch there at meshrun's floor is
#     kept; otherwise (none, a CPU build, an older one: said so) the build the driver runs is
#     installed: PyPI's CUDA 13 build with driver 580+, else PyTorch's CUDA 12 index
#     (src/meshrun/core/torch_build.py chooses, from nvidia-smi's CUDA version and the GPUs'
#     compute capabilities); then torch must see the GPUs nvidia-smi lists (CUDA_VISIBLE_DEVICES
#     applied), or this fails naming the MESHRUN_TORCH_SPEC to set;
#   - otherwise a torch already there is kept (your own build), else the CPU wheel: from pip's
#     configured sources if they have it (a local wheel directory), else PyTorch's CPU index.
# MESHRUN_INSTALL_DRY_RUN=1 prints what would be installed instead of installing it.
# With uv beside the python (make install puts it there) uv installs, pip otherwise: unpacking
# the CPU wheel takes pip 33 s on 2 cores, uv 3 s (and 20 s more to compile its bytecode,
# which pip also does: where PYTHONDONTWRITEBYTECODE is set, as on CI, every process
# would otherwise compile torch anew on import, which doubled the test suite's time).
set -euo pipefail
python=${1:?usage: install-torch.sh PYTHON}
cpu_version=2.13.0
uv="$(dirname "$python")/uv"
# The decisions run in $python before meshrun is installed: its standard library only.
src="$(cd "$(dirname "$0")/.." && pwd)/src"

install() {
  if [ -n "${MESHRUN_INSTALL_DRY_RUN:-}" ]; then
    echo "would install: $*"
    return
  fi
  if [ -x "$uv" ]; then
    # uv reads no pip config: hand it pip's local wheel directory, if there is one
    local links=${PIP_FIND_LINKS:-$("$python" -m pip config get global.find-links 2>/dev/null || true)}
    "$uv" pip install --quiet --compile-bytecode --python "$python" \
      ${links:+--find-links "$links"} "$@"
  else
    "$python" -m pip install "$@"
  fi
}

torch_build() {
  PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" "$python" -m meshrun.core.torch_build "$@"
}

if [ -n "${MESHRUN_TORCH_SPEC:-}" ]; then
  read -r -a spec <<< "$MESHRUN_TORCH_SPEC"
  verdict=install
  install "${spec[@]}"
else
  # one a line: cpu (no GPU visible), keep, or install and pip's arguments
  decision=$(torch_build choose)
  mapfile -t build <<< "$decision"
  verdict=${build[0]}
  if [ "$verdict" = install ]; then
    install "${build[@]:1}"
  elif [ "$verdict" = cpu ] && "$python" -c "import torch" 2>/dev/null; then
    echo "torch $("$python" -c 'import torch; print(torch.__version__)') already installed: kept"
  elif [ "$verdict" = cpu ]; then
    install "torch==${cpu_version}+cpu" 2>/dev/null \
      || install "torch==${cpu_version}+cpu" \
           --index-url https://download.pytorch.org/whl/cpu \
           --extra-index-url https://pypi.org/simple
  fi
fi
# What is there now must see the GPUs nvidia-smi lists (a dry run installed nothing to look at).
if [ "$verdict" = keep ] || [ -z "${MESHRUN_INSTALL_DRY_RUN:-}" ]; then
  torch_build check
fi
