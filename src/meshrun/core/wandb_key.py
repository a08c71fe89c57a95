"""Whether W&B has an API key on this host, where wandb itself looks (WANDB_API_KEY, or the
netrc entry `wandb login` writes for its host), without reading the key into meshrun: it
never enters a config, a log or a record."""

from __future__ import annotations

import netrc
import os
from urllib.parse import urlparse

WANDB_HOST = "https://api.wandb.ai"


def wandb_host() -> str:
    """The W&B server runs log to: wandb's default, or a self-hosted one (WANDB_BASE_URL)."""
    return urlparse(os.environ.get("WANDB_BASE_URL") or WANDB_HOST).hostname or ""


def has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(wandb_host()) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False
