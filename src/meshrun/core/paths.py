"""Where the project's files live (configs ship beside the package in the source tree)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
CONF_DIR = REPO_ROOT / "conf"
