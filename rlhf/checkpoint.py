"""Run checkpoints on disk: save and load each trainer rank's state, commit a step, find the one to
resume from, prune old ones, and export a checkpoint as an HF model directory.

Format (version 1), one directory per saved step:

    ROOT/step_000010/
      rank_00000.safetensors  trainer rank 0's `ParallelTrainer.state_dict()`: its parameters (our
                              names) and optimizer state (`optim/<bucket kind>/<master|exp_avg|
                              exp_avg_sq|step>`)
      rank_00000.json         that rank's layout (degrees, coordinates, expert map, stage layers) and,
                              for each local tensor, its shape, dtype and the HF pieces it holds (HF
                              name, global shape, box, offset in the tensor)
      ...                     one pair per trainer rank, each written by its rank
      driver.json             what the driver passed to `commit`: step, data cursor, RNG states, ...
      COMPLETE                written last, by the driver, once every rank has saved

Every file is written under a temporary name, flushed to disk and renamed, so a file that exists is
whole. A directory without COMPLETE is a save that did not finish: `latest` and `resolve_resume`
never pick it, `load_rank` and `export_hf` refuse it, `prune` removes it once a newer step completed.

Resuming needs the layout, expert map and stage split the checkpoint was saved with (the optimizer
state is sharded by them); `export_hf` turns any checkpoint into an HF directory, from which a run
with another layout (or vLLM, or transformers) starts.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rlhf.errors import ConfigError
from rlhf.schema import ModelConfig
from rlhf.model.hf_io import from_hf_tensors, save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.model.shapes import param_shapes
from weight_sync.pieces import assemble, buffer_region
from weight_sync.spec import Box, Piece

FORMAT = 1
COMPLETE = "COMPLETE"
DRIVER_FILE = "driver.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def _rank_paths(ckpt_dir: Path, rank: int) -> tuple[Path, Path]:
    return ckpt_dir / f"rank_{rank:05d}.safetensors", ckpt_dir / f"rank_{rank:05d}.json"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write through `write(tmp)`, flush to disk, then rename: readers see the whole file or none."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    _fsync(tmp)
    os.replace(tmp, path)


def _write_json(path: Path, obj) -> None:
    _write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1) + "\n"))


# --- one trainer rank ---
def _layout_meta(trainer) -> dict:
    """What a checkpoint must share with the trainer that loads it."""
    L = trainer.layout
    return {"layout": str(L), "pp": L.pp, "dp": L.dp, "tp": L.tp, "ep": L.ep,
            "experts_over_tp_ep": L.experts_over_tp_ep, "world_size": L.world_size,
            "expert_map": list(trainer.expert_map), "stage_layers": [[r.start, r.stop] for r in trainer.stages]}


def _rank_meta(trainer, state: dict[str, torch.Tensor]) -> dict:
    c = trainer.layout.coords(trainer.rank)
    shapes = param_shapes(trainer.cfg)
    tensors = {name: {"shape": list(shape), "dtype": str(state[name].dtype).removeprefix("torch."), "pieces": []}
               for name, shape in trainer.sharding.local_shapes.items()}
    for p in trainer.sharding.pieces:
        tensors[p.buffer]["pieces"].append({"param": p.param, "global_shape": list(shapes[p.param]),
                                            "start": list(p.box.start), "size": list(p.box.size),
                                            "offset": list(p.offset)})
    return {"format": FORMAT, "rank": trainer.rank, "layout": _layout_meta(trainer),
            "coords": {"pp": c.pp, "dp": c.dp, "tp": c.tp, "ep_index": trainer.layout.ep_index(trainer.rank)},
            # where expert-load balancing has placed each MoE layer's experts (the tensors' pieces follow it)
            "expert_maps": [list(m) for m in trainer.expert_maps],
            "tensors": tensors}


def save_rank(ckpt_dir: str | Path, rank: int, trainer) -> int:
    """Write `trainer`'s state (a `ParallelTrainer` of rank `rank`) into `ckpt_dir`; returns the bytes
    of its safetensors file. Every rank calls this; then the driver calls `commit`."""
    if rank != trainer.rank:
        raise ValueError(f"save_rank(rank={rank}) called with the trainer of rank {trainer.rank}")
    d = Path(ckpt_dir)
    if is_complete(d):
        raise ValueError(f"{d} is already a complete checkpoint; save under a new step directory or remove it first")
    d.mkdir(parents=True, exist_ok=True)
    state = {k: t.detach().cpu().contiguous() for k, t in trainer.state_dict().items()}
    st_path, meta_path = _rank_paths(d, rank)
    meta = {"format": "pt", "rlhf_checkpoint": str(FORMAT), "layout": str(trainer.layout), "rank": str(rank)}
    _write_atomic(st_path, lambda tmp: save_file(state, str(tmp), metadata=meta))
    _write_json(meta_path, _rank_meta(trainer, state))
    return st_path.stat().st_size


def _read_rank_meta(ckpt_dir: Path, rank: int) -> dict:
    st_path, meta_path = _rank_paths(ckpt_dir, rank)
    if not (st_path.is_file() and meta_path.is_file()):
        raise ValueError(f"{ckpt_dir}: no {st_path.name} / {meta_path.name}; the checkpoint was saved by "
                         "fewer trainer ranks than this layout has, or a file was removed")
    return json.loads(meta_path.read_text())


def _require_complete(ckpt_dir: Path, what: str) -> None:
    if not is_complete(ckpt_dir):
        raise ValueError(f"cannot {what} {ckpt_dir}: it has no {COMPLETE} marker, so its save did not finish "
                         "(the run stopped mid-save?); use an earlier step directory")


def load_rank(ckpt_dir: str | Path, rank: int, trainer) -> None:
    """Restore `trainer` (rank `rank`) from a complete checkpoint saved with the same layout."""
    d = Path(ckpt_dir)
    _require_complete(d, "resume from")
    meta = _read_rank_meta(d, rank)
    saved, running = meta["layout"], _layout_meta(trainer)
    if saved != running:
        diff = [k for k in running if saved.get(k) != running[k]]
        raise ValueError(
            f"{d} was saved by trainer layout {saved['layout']} ({saved['world_size']} ranks, expert map "
            f"{saved['expert_map']}, stage layers {saved['stage_layers']}); this run uses layout {running['layout']} "
            f"({running['world_size']} ranks, expert map {running['expert_map']}, stage layers "
            f"{running['stage_layers']}); they differ in {diff}. Resume with the saved layout, or export the "
            f"checkpoint (rlhf.checkpoint.export_hf) and start the new layout from that HF directory "
            f"(optimizer state is not carried over)")
    maps = meta.get("expert_maps") or [trainer.expert_map] * trainer.moe_layers  # saved before balancing existed
    if tuple(map(tuple, maps)) != tuple(trainer.expert_maps):
        trainer.migrate_experts(maps, move_state=False)  # the saved placement: the state below fills it
    st_path, _ = _rank_paths(d, rank)
    trainer.load_state_dict(load_file(str(st_path)), source=f"{st_path} (layout {saved['layout']}, rank {rank})")


# --- the driver's side ---
def commit(ckpt_dir: str | Path, driver_state: dict) -> Path:
    """Mark a step saved: write driver.json (`driver_state`, JSON-able) and then COMPLETE. Call it once
    every rank's `save_rank` has returned."""
    d = Path(ckpt_dir)
    world = _read_rank_meta(d, 0)["layout"]["world_size"]
    missing = [r for r in range(world) if not all(p.is_file() for p in _rank_paths(d, r))]
    if missing:
        raise ValueError(f"cannot commit {d}: trainer ranks {missing} of {world} have not saved there; commit "
                         "only after every rank's save_rank returned")
    try:
        text = json.dumps(driver_state, indent=1) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"driver state for {d} is not JSON-able ({e}); pass plain numbers, strings, lists "
                         "and dicts (rng_state() gives the RNG states in that form)") from e
    _write_atomic(d / DRIVER_FILE, lambda tmp: tmp.write_text(text))
    _write_json(d / COMPLETE, {"format": FORMAT, "ranks": world})
    _fsync(d)
    return d


def load_driver_state(ckpt_dir: str | Path) -> dict:
    d = Path(ckpt_dir)
    _require_complete(d, "resume from")
    return json.loads((d / DRIVER_FILE).read_text())


def is_complete(ckpt_dir: str | Path) -> bool:
    return (Path(ckpt_dir) / COMPLETE).is_file()


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def complete_steps(root: str | Path) -> list[Path]:
    """Complete step directories under `root`, oldest first."""
    return [p for _, p in _step_dirs(Path(root)) if is_complete(p)]


def fresh_run_problem(root: str | Path, resume: str, saves: bool) -> str | None:
    """Why a run that does not resume (`checkpoint.resume: never`) and saves checkpoints (`saves`) must not
    start in `root`: it holds another run's complete checkpoints, which this run's saves would collide
    with (the same step) or be pruned together with. None when there is nothing in the way."""
    if resume != "never" or not saves:
        return None
    done = complete_steps(root)
    if not done:
        return None
    return (f"checkpoint.dir={root} already holds {len(done)} complete checkpoint(s) of an earlier run (newest "
            f"{done[-1].name}); this run starts afresh (checkpoint.resume=never) and would save into the same "
            f"directory. Continue that run with checkpoint.resume=auto, give this one another checkpoint.dir, or "
            f"move the old checkpoints away")


def queued_groups_problem(resume_dir: Path | None, max_staleness: int) -> str | None:
    """Why a synchronous run (`stale_sync.max_staleness` 0) must not resume `resume_dir`: it is a StaleSync
    checkpoint whose queue holds groups generated ahead of it. Their prompts are behind the saved data cursor,
    so the synchronous loop would skip them without a word. None when nothing would be lost."""
    if resume_dir is None or max_staleness > 0:
        return None
    queued = load_driver_state(resume_dir).get("stale_sync", {}).get("queue", {}).get("groups", [])
    if not queued:
        return None
    return (f"checkpoint {resume_dir} was saved by a StaleSync run with {len(queued)} group(s) generated ahead and "
            f"not yet trained on; resuming it with stale_sync.max_staleness=0 would skip their prompts. Resume with "
            f"stale_sync.max_staleness set as in that run (>= 1), or resume from another checkpoint")


def latest(root: str | Path) -> Path | None:
    """The newest complete step directory under `root`, or None."""
    done = complete_steps(root)
    return done[-1] if done else None


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` complete checkpoints (keep_last <= 0 keeps all), and
    unfinished saves older than the newest complete one. Returns the removed directories."""
    steps = _step_dirs(Path(root))
    done = [(s, p) for s, p in steps if is_complete(p)]
    if keep_last <= 0 or not done:
        return []
    newest = done[-1][0]
    doomed = [p for _, p in done[:-keep_last]] + [p for s, p in steps if not is_complete(p) and s < newest]
    for p in doomed:
        (p / COMPLETE).unlink(missing_ok=True)  # first: a deletion cut short must not look complete
        shutil.rmtree(p)
    return doomed


def resolve_resume(root: str | Path, resume: str) -> Path | None:
    """The step directory to resume from for `checkpoint.resume`: "never" -> None; "auto" -> the newest
    complete one under `root` (None if there is none); anything else is a step directory (absolute,
    relative to the working directory, or a name under `root`) that must be complete."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest(root)
    root = Path(root)
    done = complete_steps(root)
    choices = (f"complete ones under {root}: {', '.join(p.name for p in done[-3:])}" if done
               else f"there is no complete checkpoint under {root}")
    p = Path(resume)
    if not p.is_dir() and not p.is_absolute() and (root / p).is_dir():
        p = root / p
    if not p.is_dir():
        raise ConfigError(f"checkpoint.resume={resume!r}: no such directory; use never, auto or a step directory "
                         f"({choices})")
    if not is_complete(p):
        if _step_dirs(p):
            raise ConfigError(f"checkpoint.resume={resume!r} is a checkpoint root, not a step directory; use "
                             f"checkpoint.resume=auto with checkpoint.dir={p}, or one of its step directories")
        raise ConfigError(f"checkpoint.resume={resume!r} has no {COMPLETE} marker: its save did not finish (the "
                         f"run stopped mid-save?); pick a complete one or use auto ({choices})")
    return p


# --- export ---
def _pieces(meta: dict) -> list[tuple[Piece, tuple[int, ...]]]:
    return [(Piece(p["param"], Box(tuple(p["start"]), tuple(p["size"])), buffer, tuple(p["offset"])),
             tuple(p["global_shape"]))
            for buffer, t in meta["tensors"].items() for p in t["pieces"]]


def export_hf(ckpt_dir: str | Path, model_cfg: ModelConfig, out_dir: str | Path,
              tokenizer_dir: str | Path | None = None) -> Path:
    """Assemble the full model from every rank file of a complete checkpoint (each element read once,
    from the first rank holding it; replicas skipped) and write it as an HF directory with
    `save_pretrained`, plus the tokenizer files of `tokenizer_dir`. Holds the full model in memory."""
    d = Path(ckpt_dir)
    _require_complete(d, "export")
    world = _read_rank_meta(d, 0)["layout"]["world_size"]
    expected = {n: s for n, s in param_shapes(model_cfg).items()
                if not (model_cfg.tie_word_embeddings and n == "lm_head.weight")}
    chosen: dict[str, dict[Box, tuple[int, Piece]]] = {}
    for rank in range(world):
        for piece, global_shape in _pieces(_read_rank_meta(d, rank)):
            if piece.param not in expected:
                raise ValueError(f"{d}: rank {rank} holds {piece.param}, which model {model_cfg.name!r} does not "
                                 "have; export with the model config the run trained")
            if global_shape != expected[piece.param]:
                raise ValueError(f"{d}: {piece.param} has global shape {global_shape} in the checkpoint, "
                                 f"{expected[piece.param]} in model {model_cfg.name!r}; export with the model config "
                                 "the run trained")
            chosen.setdefault(piece.param, {}).setdefault(piece.box, (rank, piece))
    for name, shape in expected.items():
        boxes = list(chosen.get(name, {}))
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                if a.intersect(b) is not None:
                    raise ValueError(f"{d}: {name} is held in overlapping boxes {a} and {b} by different ranks")
        held, total = sum(b.numel for b in boxes), Box.full(shape).numel
        if held != total:
            raise ValueError(f"{d}: the rank files hold {held} of the {total} elements of {name}; the checkpoint "
                             "is missing rank files or was not written by this trainer")
    by_rank: dict[int, list[Piece]] = {}
    for held in chosen.values():
        for rank, piece in held.values():
            by_rank.setdefault(rank, []).append(piece)
    full: dict[str, torch.Tensor] = {}
    for rank, pieces in sorted(by_rank.items()):
        with safe_open(str(_rank_paths(d, rank)[0]), framework="pt") as f:
            buffers = {name: f.get_tensor(name) for name in {p.buffer for p in pieces}}
            assemble(pieces, expected, buffer_region(buffers), full)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(model_cfg)
    model.load_state_dict(from_hf_tensors(((n, full[n]) for n in expected), model_cfg), strict=True, assign=True)
    if model_cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return save_pretrained(model, out_dir, tokenizer_dir)


# --- RNG states, JSON-able ---
def rng_state() -> dict:
    """Python's `random` and torch's CPU generator, as JSON-able values (for driver.json)."""
    version, internal, gauss_next = random.getstate()
    return {"python": [version, list(internal), gauss_next],
            "torch_cpu": base64.b64encode(bytes(torch.get_rng_state().tolist())).decode("ascii")}


def set_rng_state(state: dict) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(torch.tensor(list(base64.b64decode(state["torch_cpu"])), dtype=torch.uint8))
