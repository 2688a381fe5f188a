"""Run checkpoints without processes: step directories, COMPLETE, latest/prune/resolve_resume, driver
state, RNG states, and export_hf from rank files written by stand-in trainers (local tensors cut from
one full model by the real sharding), against the full model bit for bit."""

import json
import random

import pytest
import torch

from rlhf import checkpoint as ckpt
from rlhf.schema import ModelConfig
from rlhf.model.hf_io import iter_safetensors, load_pretrained, to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.sharding.trainer import rank_sharding
from weight_sync.pieces import local_tensors
from rlhf.sharding.layout import Layout, default_expert_map

CFG = ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  first_k_dense_layers=1, intermediate_size=24)


class StandInTrainer:
    """What checkpoint.py reads from a ParallelTrainer, cut from a full model without processes."""

    def __init__(self, layout: Layout, rank: int, full_hf: dict, stage_split=None):
        self.cfg, self.layout, self.rank = CFG, layout, rank
        self.expert_map = default_expert_map(CFG.num_experts, layout.expert_shards)
        self.moe_layers = CFG.num_hidden_layers - CFG.first_k_dense_layers
        self.expert_maps = (self.expert_map,) * self.moe_layers
        self.stages = layout.stage_layers(CFG.num_hidden_layers, stage_split)
        self.sharding = rank_sharding(CFG, layout, rank, None, stage_split)
        self.tensors = local_tensors(full_hf, self.sharding)
        self.loaded = None

    def state_dict(self):
        return dict(self.tensors) | {"optim/dp/step": torch.tensor(3.0)}

    def load_state_dict(self, sd, source):
        self.loaded = sd


@pytest.fixture(scope="module")
def full_hf():
    m = Qwen3MoeForCausalLM(CFG)
    m.init_weights(seed=3, std=0.2)
    return {n: t.clone() for n, t in to_hf_tensors(m.state_dict(), CFG)}


def save_all(d, layout, full_hf, driver_state=None, stage_split=None):
    trainers = [StandInTrainer(layout, r, full_hf, stage_split) for r in range(layout.world_size)]
    for r, t in enumerate(trainers):
        assert ckpt.save_rank(d, r, t) > 0
    if driver_state is not None:
        ckpt.commit(d, driver_state)
    return trainers


def make_steps(root, complete, torn=()):
    for s in complete:
        d = ckpt.step_dir(root, s)
        d.mkdir(parents=True)
        (d / ckpt.COMPLETE).write_text("{}")
    for s in torn:
        ckpt.step_dir(root, s).mkdir(parents=True)


def test_step_dir_names_sort_by_step(tmp_path):
    assert ckpt.step_dir(tmp_path, 10).name == "step_000010"
    make_steps(tmp_path, [2, 10, 9])
    assert [p.name for p in ckpt.complete_steps(tmp_path)] == ["step_000002", "step_000009", "step_000010"]


def test_latest_ignores_directories_without_complete(tmp_path):
    assert ckpt.latest(tmp_path / "nothing_here") is None
    make_steps(tmp_path, [1, 3], torn=[5])
    (tmp_path / "notes").mkdir()
    assert ckpt.latest(tmp_path) == ckpt.step_dir(tmp_path, 3)


def test_prune_keeps_last_n_and_newer_unfinished_saves(tmp_path):
    make_steps(tmp_path, [1, 2, 4, 5], torn=[3, 6])
    assert ckpt.prune(tmp_path, keep_last=0) == []
    removed = ckpt.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step_000001", "step_000002", "step_000003"]
    # step 6 may be a save in progress: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000005", "step_000006"]
    assert ckpt.prune(tmp_path, keep_last=2) == []


def test_resolve_resume(tmp_path):
    root = tmp_path / "ckpts"
    assert ckpt.resolve_resume(root, "never") is None
    assert ckpt.resolve_resume(root, "auto") is None
    make_steps(root, [1, 2], torn=[3])
    assert ckpt.resolve_resume(root, "auto") == ckpt.step_dir(root, 2)
    assert ckpt.resolve_resume(root, str(ckpt.step_dir(root, 1))) == ckpt.step_dir(root, 1)
    assert ckpt.resolve_resume(root, "step_000001") == ckpt.step_dir(root, 1)  # a name under the root
    with pytest.raises(ValueError, match=r"no such directory.*step_000001, step_000002"):
        ckpt.resolve_resume(root, str(tmp_path / "typo"))
    with pytest.raises(ValueError, match=r"no COMPLETE marker.*did not finish.*auto"):
        ckpt.resolve_resume(root, str(ckpt.step_dir(root, 3)))
    with pytest.raises(ValueError, match=r"checkpoint root, not a step directory.*resume=auto"):
        ckpt.resolve_resume(tmp_path, str(root))


def test_rng_state_is_json_and_restores_the_streams():
    state = json.loads(json.dumps(ckpt.rng_state()))
    want = (random.random(), torch.rand(3))
    random.random(), torch.rand(5)  # move on
    ckpt.set_rng_state(state)
    got = (random.random(), torch.rand(3))
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def test_commit_needs_every_rank_and_json(tmp_path, full_hf):
    layout = Layout(tp=2)
    d = ckpt.step_dir(tmp_path, 1)
    ckpt.save_rank(d, 0, StandInTrainer(layout, 0, full_hf))
    with pytest.raises(ValueError, match=r"ranks \[1\] of 2 have not saved"):
        ckpt.commit(d, {"step": 1})
    ckpt.save_rank(d, 1, StandInTrainer(layout, 1, full_hf))
    with pytest.raises(ValueError, match="not JSON-able"):
        ckpt.commit(d, {"step": object()})
    assert not ckpt.is_complete(d) and ckpt.latest(tmp_path) is None
    state = {"step": 1, "sampler": {"epoch": 0, "position": 16, "seed": 0}, "rng": ckpt.rng_state()}
    ckpt.commit(d, state)
    assert ckpt.latest(tmp_path) == d and ckpt.load_driver_state(d) == state
    assert not list(d.glob("*.tmp"))
    with pytest.raises(ValueError, match="already a complete checkpoint"):
        ckpt.save_rank(d, 0, StandInTrainer(layout, 0, full_hf))


def test_rank_json_describes_layout_and_boxes(tmp_path, full_hf):
    layout = Layout(dp=2, tp=2, ep=2)
    save_all(tmp_path, layout, full_hf)
    meta = json.loads((tmp_path / "rank_00003.json").read_text())
    assert meta["coords"] == {"pp": 0, "dp": 1, "tp": 1, "ep_index": 1}
    assert meta["layout"]["layout"] == str(layout) and meta["layout"]["world_size"] == 4
    q = meta["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["shape"] == [16, 32] and q["dtype"] == "float32"
    assert q["pieces"] == [{"param": "model.layers.0.self_attn.q_proj.weight", "global_shape": [32, 32],
                            "start": [16, 0], "size": [16, 32], "offset": [0, 0]}]
    experts = meta["tensors"]["model.layers.1.mlp.experts.gate_up_proj"]["pieces"]
    assert [p["param"] for p in experts] == [f"model.layers.1.mlp.experts.{e}.{k}_proj.weight"
                                             for e in (2, 3) for k in ("gate", "up")]


def test_load_rank_refuses_torn_and_other_layouts(tmp_path, full_hf):
    save_all(tmp_path, Layout(dp=2, ep=2), full_hf)
    other = StandInTrainer(Layout(dp=2), 0, full_hf)
    with pytest.raises(ValueError, match="no COMPLETE marker"):
        ckpt.load_rank(tmp_path, 0, other)
    ckpt.commit(tmp_path, {"step": 0})
    with pytest.raises(ValueError, match=r"saved by trainer layout dp2xep2 .*this run uses layout dp2 .*differ in "
                                         r"\['layout', 'ep', 'expert_map'\]"):
        ckpt.load_rank(tmp_path, 0, other)
    same = StandInTrainer(Layout(dp=2, ep=2), 1, full_hf)
    ckpt.load_rank(tmp_path, 1, same)
    assert set(same.loaded) == set(same.state_dict())
    assert all(torch.equal(same.loaded[n], t) for n, t in same.state_dict().items())


@pytest.mark.parametrize("layout,split", [(Layout(dp=2, tp=2, ep=2), None), (Layout(pp=2, tp=2), [1, 1]),
                                          (Layout(dp=2, tp=2, ep=2, experts_over_tp_ep=True), None)],
                         ids=str)
def test_export_hf_equals_the_full_model(tmp_path, full_hf, layout, split):
    d = tmp_path / "step_000001"
    save_all(d, layout, full_hf, {"step": 1}, split)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    out = ckpt.export_hf(d, CFG, d / "hf", tokenizer_dir=tok)  # inside the step: still one step directory
    assert ckpt.complete_steps(tmp_path) == [d]
    got = dict(iter_safetensors(out))
    assert set(got) == set(full_hf)
    for n, t in full_hf.items():
        assert torch.equal(got[n], t), n
    assert (out / "tokenizer.json").is_file()
    load_pretrained(out)


def test_export_hf_names_an_uncovered_tensor(tmp_path, full_hf):
    save_all(tmp_path, Layout(tp=2), full_hf, {"step": 1})
    meta_path = tmp_path / "rank_00001.json"
    meta = json.loads(meta_path.read_text())
    meta["tensors"]["model.layers.0.self_attn.o_proj.weight"]["pieces"] = []
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"hold 512 of the 1024 elements of model\.layers\.0\.self_attn\.o_proj"):
        ckpt.export_hf(tmp_path, CFG, tmp_path / "hf")
    other = ModelConfig(**(CFG.__dict__ | {"hidden_size": 64}))
    with pytest.raises(ValueError, match="global shape .* export with the model config"):
        ckpt.export_hf(tmp_path, other, tmp_path / "hf")
    (tmp_path / ckpt.COMPLETE).unlink()
    with pytest.raises(ValueError, match="cannot export .* no COMPLETE marker"):
        ckpt.export_hf(tmp_path, CFG, tmp_path / "hf")


def test_a_fresh_run_refuses_a_checkpoint_dir_holding_another_runs_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    assert ckpt.fresh_run_problem(root, "never", saves=True) is None  # nothing there yet
    done = ckpt.step_dir(root, 350)
    done.mkdir(parents=True)
    (done / ckpt.COMPLETE).write_text("")
    problem = ckpt.fresh_run_problem(root, "never", saves=True)
    assert "already holds 1 complete checkpoint" in problem and "step_000350" in problem
    assert "checkpoint.resume=auto" in problem and "another checkpoint.dir" in problem
    assert ckpt.fresh_run_problem(root, "auto", saves=True) is None  # resuming it is what the dir is for
    assert ckpt.fresh_run_problem(root, "never", saves=False) is None  # a run that saves nothing collides with nothing
    (ckpt.step_dir(root, 5)).mkdir()  # an unfinished save of a crashed run is not in the way
    assert "1 complete" in ckpt.fresh_run_problem(root, "never", saves=True)


def test_a_synchronous_run_refuses_a_stalesync_checkpoint_with_queued_groups(tmp_path):
    """The queued groups' prompts are behind the saved cursor: the synchronous loop would skip them."""
    import json

    d = ckpt.step_dir(tmp_path, 2)
    d.mkdir(parents=True)
    (d / ckpt.DRIVER_FILE).write_text(json.dumps({"step": 2, "stale_sync": {"queue": {"groups": [{"seq": 64}] * 3},
                                                                          "next_batch": 4, "next_seq": 96}}))
    (d / ckpt.COMPLETE).write_text("{}")
    problem = ckpt.queued_groups_problem(d, max_staleness=0)
    assert "3 group(s) generated ahead" in problem and "stale_sync.max_staleness set as in that run" in problem
    assert ckpt.queued_groups_problem(d, max_staleness=1) is None  # the StaleSync run takes them first
    assert ckpt.queued_groups_problem(None, max_staleness=0) is None
    (d / ckpt.DRIVER_FILE).write_text(json.dumps({"step": 2}))  # a synchronous run's checkpoint
    assert ckpt.queued_groups_problem(d, max_staleness=0) is None
