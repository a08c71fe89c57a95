"""torch's single-tensor all-gather and reduce-scatter under the names the installed torch
has: renamed in newer torch (`*_single`, where the old names warn), the floor has only the
old ones."""

from __future__ import annotations

import torch.distributed as dist

ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
