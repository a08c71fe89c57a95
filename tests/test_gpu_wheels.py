"""scripts/build-gpu-wheels.sh's decisions (scripts/gpu_wheels.py): what an offline GPU image
has is read off its description, resolved against, and never carried; what it lacks or has
too old is; the set and the tree must fit what the device tool carries."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from gpu_wheels import (  # noqa: E402 (scripts/ is no package)
    IMAGE,
    NEWER,
    Package,
    constraints,
    image_packages,
    kind_of,
    over_limit,
    parse_lock,
    torch_only,
)

DESCRIPTION = """The image.

```
huggingface-hub==1.33.0
numpy==2.5.2
rich
tokenizers==0.23.2
torch==2.11.0+cu130
transformers==5.17.0
```
"""

LOCK = """hydra-core==1.3.8
    # via -r requirements.in
jinja2==3.1.6
    # via torch
markupsafe==3.0.4
    # via jinja2
nvidia-nccl-cu13==2.28.9
    # via torch
filelock==4.3.2
    # via
    #   datasets
    #   torch
torch==2.11.0
    # via torchft
transformers==5.24.0
    # via -r requirements.in
"""


def test_the_image_description_gives_versions_where_it_saw_them():
    image = image_packages(DESCRIPTION)
    assert image == {
        "huggingface-hub": "1.33.0",
        "numpy": "2.5.2",
        "rich": None,
        "tokenizers": "0.23.2",
        "torch": "2.11.0",  # the local label +cu130 dropped
        "transformers": "5.17.0",
    }
    assert "transformers==5.17.0" not in constraints(image)  # meshrun needs it newer
    assert {"tokenizers==0.23.2", "huggingface-hub==1.33.0", "torch==2.11.0"} <= set(
        constraints(image)
    )
    assert "transformers" in NEWER


@pytest.mark.skipif(not IMAGE.exists(), reason="no ../shared/gpu-node-image.md beside the tree")
def test_the_shared_description_of_the_gpu_node_parses():
    image = image_packages(IMAGE.read_text())
    assert image["torch"] == "2.11.0" and image["tokenizers"] == "0.23.2"
    assert "hydra-core" not in image and len(image) > 100


def test_what_the_cuda_stack_alone_needs_stays_with_the_images_torch():
    pins, parents = parse_lock(LOCK)
    assert pins["transformers"] == "5.24.0" and parents["filelock"] == {"datasets", "torch"}
    only = torch_only(parents)
    assert only == {"jinja2", "markupsafe"}  # filelock is datasets' too
    image = image_packages(DESCRIPTION)
    kinds = {n: kind_of(n, v, image, only) for n, v in pins.items()}
    assert kinds == {
        "hydra-core": "new",
        "jinja2": "torch",
        "markupsafe": "torch",
        "nvidia-nccl-cu13": "cuda",
        "filelock": "new",
        "torch": "cuda",
        "transformers": "newer",
    }


def test_a_resolution_that_moves_a_pinned_image_package_is_refused():
    image = image_packages(DESCRIPTION)
    with pytest.raises(SystemExit, match=r"numpy resolved to 2\.6\.0, the image has 2\.5\.2"):
        kind_of("numpy", "2.6.0", image, set())
    assert kind_of("numpy", "2.5.2", image, set()) == "image"
    assert kind_of("rich", "15.0.0", image, set()) == "unknown"  # sized later


def test_a_set_over_the_limit_names_its_largest_wheels():
    mib = 2**20
    carried = [
        Package("wandb", "0.31.0", "new", "wandb.whl", 19 * mib),
        Package("transformers", "5.24.0", "newer", "transformers.whl", 13 * mib),
        Package("rich", "15.0.0", "fallback", "rich.whl", mib // 4),
    ]
    assert over_limit(carried, 2 * mib, limit_mib=60) is None
    why = over_limit(carried, 2 * mib, limit_mib=30)
    assert why is not None and "34.2 MiB, over 30" in why
    assert why.index("wandb.whl 19.0") < why.index("transformers.whl 13.0")
