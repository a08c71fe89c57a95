#!/usr/bin/env bash
# Wheels of meshrun's runtime needs for a GPU image that has its own torch and no network
# (the lent GPU machine: CPython 3.12, manylinux x86_64, torch 2.11), built here where PyPI
# is reachable, carried with the tree (the device tool carries 64 MiB in all, the tree ~1.3 MiB
# of it) and installed there offline by scripts/gpu-check.sh:
#
#   scripts/build-gpu-wheels.sh                  # -> outputs/gpu-wheels (ignored by git)
#   # on the image, before the checks (gpu-check.sh does this when the folder is there):
#   python3 -m pip install --no-index --find-links outputs/gpu-wheels \
#       -r outputs/gpu-wheels/requirements.txt
#
# What: pyproject.toml's dependencies without torch, the hf extra (the gpu check trains
# hf/llama-3.2-1b; tests/conftest.py imports transformers and datasets), the ft extra
# (torchft and its opentelemetry: 2.7 MiB for CPython 3.12), the float8 extra (torchao
# 0.18: one cp310-abi3 wheel of 3.3 MiB, no dependencies), pytest and
# pytest-timeout: every wheel they need for that platform, resolved here. torch is never
# among them, so an offline install cannot replace the image's own build (it is not in the
# folder to be taken). Packages already installed there that satisfy a requirement are kept.
#
# Size: the whole set is 76 wheels, 155 MiB (pyarrow alone 54), over what the tool carries; so
# the large wheels of projects the image already holds (SKIP below, from the lent machine's
# package list) are left out: 65 wheels, 44.5 MiB (wandb 19.4 of it, transformers 12.9),
# and torchao since (66 wheels, ~47.8 MiB; its 3.3 MiB wheel measured, the set not rebuilt).
# If the image's copy of a skipped project is too old for what was resolved here, the offline
# install fails naming it: take it out of SKIP (SKIP= keeps everything). WANDB=0 leaves wandb
# and its needs out (44 wheels, 23 MiB): gpu-check.sh then runs tests/test_gpu.py alone, as it
# does where wandb is missing. Checked on a stand-in of the image (CPython 3.12, torch 2.11.0,
# numpy 2.5.2, transformers 5.17.0, huggingface-hub 1.33.0, tokenizers 0.23.2, ...): the
# offline install took 50 s on 2 cores, kept torch and lifted transformers to the floor's.
#
# antlr4-python3-runtime 4.9 (hydra-core's parser) is on PyPI as a source archive only: it is
# built here into a pure-Python wheel first, which any platform installs.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-outputs/gpu-wheels}
python_version=${GPU_PYTHON_VERSION:-3.12}
# The image's own large packages (its pip list).
SKIP=${SKIP-numpy pyarrow pandas matplotlib pillow fonttools contourpy kiwisolver tokenizers hf-xet
  pygments}
py=${PYTHON:-python3}

all=$(mktemp -d "${TMPDIR:-/tmp}/meshrun-gpu-wheels.XXXXXX")  # the whole resolved set
trap 'rm -rf "$all"' EXIT
rm -rf "$dir"
mkdir -p "$dir"

# The requirements, read off pyproject.toml.
WANDB=${WANDB:-1} "$py" - >"$dir/requirements.txt" <<'PY'
import os, re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
reqs = [*project["dependencies"], *extras["hf"], *extras["ft"], *extras["float8"]]
name = lambda r: re.match(r"[A-Za-z0-9_.-]+", r)[0].lower()
dev = project["optional-dependencies"]["dev"]
reqs += [r for r in dev if re.fullmatch(r"pytest(-timeout)?", name(r))]
drop = {"torch"} | (set() if os.environ["WANDB"] == "1" else {"wandb"})
print("\n".join(r for r in reqs if name(r) not in drop))
PY

"$py" -m pip wheel --quiet --no-deps -w "$all" 'antlr4-python3-runtime==4.9.*'

platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 \
  linux; do
  platforms+=(--platform "${p}_x86_64")
done
"$py" -m pip download --quiet --progress-bar off --only-binary=:all: \
  --python-version "$python_version" --implementation cp "${platforms[@]}" \
  --find-links "$all" -d "$all" -r "$dir/requirements.txt"

# Keep all but the skipped projects' wheels.
"$py" - "$dir" "$all" "$SKIP" <<'PY'
import re, shutil, sys
from pathlib import Path
dir, all_dir, skip = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split()
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
skip = {norm(n) for n in skip}
kept = left = n = 0
for wheel in sorted(all_dir.glob("*.whl")):
    size = wheel.stat().st_size
    if norm(wheel.name.split("-")[0]) in skip:
        left += size
        continue
    shutil.copy2(wheel, dir / wheel.name)
    kept += size
    n += 1
print(f"{dir}: {n} wheels, {kept / 2**20:.1f} MiB; {left / 2**20:.1f} MiB left out "
      f"(on the image: {' '.join(sorted(skip)) or 'none'})")
PY
