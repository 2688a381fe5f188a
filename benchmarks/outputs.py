"""A benchmark run starts afresh in its config's output directory: a previous run's outputs there (steps,
checkpoints, W&B run) are kept beside it as `<output_dir>.<time>`, never overwritten or mixed in."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def keep_previous(output_dir: str | Path) -> Path | None:
    """Move `output_dir` aside if it exists; where it went, or None."""
    out = Path(output_dir)
    if not out.exists():
        return None
    kept = out.with_name(f"{out.name}.{time.strftime('%Y%m%d-%H%M%S')}")
    out.rename(kept)
    print(f"benchmark: the previous outputs in {out} are kept in {kept}", file=sys.stderr, flush=True)
    return kept
