"""The chaos benchmark's fault draws: seeded, one per step after the first checkpoint, each a valid chaos entry."""

from benchmarks.chaos import REPO, chaos_overrides, draw_faults
from rlhf.config import load_run_config


def test_draws_are_seeded_distinct_and_after_the_first_checkpoint():
    a = draw_faults(7, 6, 30, ["engine", "trainer", "driver"], 2, 2, 10, 6)
    assert a == draw_faults(7, 6, 30, ["engine", "trainer", "driver"], 2, 2, 10, 6)
    assert a != draw_faults(8, 6, 30, ["engine", "trainer", "driver"], 2, 2, 10, 6)
    steps = [f["step"] for f in a]
    assert len(set(steps)) == 6 and min(steps) >= 6 and max(steps) <= 30
    for f in draw_faults(1, 25, 30, ["engine"], 2, 2, 10, 6):  # evaluation kills only where an evaluation runs
        assert f["phase"] != "evaluate" or f["step"] % 10 == 0 or f["step"] == 30


def test_overrides_are_valid_chaos_entries_and_skip_what_a_killed_driver_already_saw():
    faults = draw_faults(3, 10, 30, ["engine", "hang", "trainer", "driver"], 2, 2, 10, 6)
    assert {"engine", "hang", "trainer", "driver"} == {f["kind"] for f in faults}
    cfg = load_run_config(REPO / "configs/tiny_cpu.yaml", ["steps=30", *chaos_overrides(faults, 0)])
    kinds = {"engine": cfg.chaos.kill_engines, "hang": cfg.chaos.stop_engines, "trainer": cfg.chaos.kill_trainer_ranks}
    for kind, entries in kinds.items():
        assert sorted(entries) == sorted(f"{f['index']}@{f['step']}:{f['phase']}" for f in faults if f["kind"] == kind)
    assert sum(len(v) for v in kinds.values()) == sum(f["kind"] != "driver" for f in faults)
    later = chaos_overrides(faults, 20)
    assert all(int(e.split("@")[1].split(":")[0]) > 20 for o in later for e in o.split("=[")[1].rstrip("]").split(","))
