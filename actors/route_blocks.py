"""Routing replay's route blocks (`rlhf.moe.routing.RouteRef`) into and out of a checkpoint, by Ray tasks: the
blocks go between the object store and the file without passing through the driver, which holds only their
references. A StaleSync checkpoint keeps the routes of the groups queued ahead of it this way."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def _write(path: str, *blocks) -> int:
    from safetensors.numpy import save_file

    tmp = Path(path).with_suffix(".tmp")
    save_file({f"block_{i}": b for i, b in enumerate(blocks)}, str(tmp))
    tmp.replace(path)
    return sum(b.nbytes for b in blocks)


def _read(path: str, n: int):
    from safetensors.numpy import load_file

    found = load_file(path)
    if len(found) != n:
        raise ValueError(f"{path} holds {len(found)} route blocks; the checkpoint's queue names {n}")
    blocks = tuple(found[f"block_{i}"] for i in range(n))
    return blocks[0] if n == 1 else blocks


def save_route_blocks(path: Path, refs: Sequence, timeout_s: float = 300.0) -> int:
    """Write the blocks behind `refs` to `path` (safetensors, `block_<i>` in order); their bytes."""
    import ray

    task = ray.remote(num_cpus=0)(_write)
    return ray.get(task.remote(str(path), *refs), timeout=timeout_s)


def load_route_blocks(path: Path, n: int) -> list:
    """References to the `n` blocks of `path`, read into the object store by a task (owned here)."""
    import ray

    if not n:
        return []
    refs = ray.remote(num_cpus=0)(_read).options(num_returns=n).remote(str(path), n)
    return [refs] if n == 1 else list(refs)
