"""W&B runs as meshrun opens and closes them, in a rank or in the driver."""

from __future__ import annotations

from typing import Any


def close_run(run: Any, exit_code: int) -> None:
    """Finishes `run` and waits until its files are complete. `finish()` returns once W&B has
    handled the run's exit, but wandb-core writes the transaction log (an offline run's
    `.wandb` file, all there is of it) through a buffer that it empties when a 32 KiB block
    fills, every 15 s, or when it closes the run's stream, which it does after `finish()`
    has returned: a run read (or synced) right after it may have lost its history.
    `teardown()` waits for the W&B service to close its streams and exit; the next run
    starts a fresh one (0.2 s)."""
    import wandb  # noqa: PLC0415 (seconds to import: only runs logged to W&B pay it)

    try:
        run.finish(exit_code=exit_code)
    finally:
        try:
            wandb.teardown()
        except SystemExit as stopped:  # teardown exits where the service exited non-zero
            raise RuntimeError(f"the W&B service exited with code {stopped.code}") from None
