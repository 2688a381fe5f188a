"""Streamed rollouts on Ray with real engines (docs/rollout.md): an engine streams each prompt's group as it
finishes, the same samples a whole generate call makes, and stops when its task is cancelled; in the loop,
groups scored as they finish and the draw's surplus stopped give the batch whole draws give for a seed, also
when an engine dies mid-stream."""

import json
import time
from pathlib import Path

import pytest

from rlhf.config import load_run_config
from rlhf.driver import train

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]
# what a seed fixes (timings, and the tokens of groups a streamed draw stopped, left out)
SAME = ("reward/mean", "reward/std", "accuracy/train", "accuracy/heldout", "response/length_mean",
        "rollout/groups_drawn", "rollout/groups_kept", "actor/loss", "actor/grad_norm", "actor/clip_fraction",
        "actor/entropy_old", "parity/max_abs_diff", "parity/mean_abs_diff", "sync/bytes_received", "sync/version")


def test_an_engine_streams_the_groups_it_generates_and_a_cancel_stops_it(tiny, ray_session):
    import ray

    from actors.group_stream import _drain
    from actors.remote import spawn
    from actors.vllm.engine import VLLMEngine
    from rlhf.data.tokenizer import load_tokenizer
    from rlhf.schema import DeviceType, RolloutConfig

    d, _ = tiny
    tok = load_tokenizer(str(d))
    prompts = [tok.encode(f"{a}+{b}=").ids for a in range(8) for b in range(8)]
    # liveness probes as in a run: the actor then runs its calls on a thread pool (a cancelled task reads its flag)
    engine = spawn(VLLMEngine, "rollout", 0, str(d), RolloutConfig(max_new_tokens=8, cpu_kv_cache_gib=0.25), DeviceType.cpu,
                   max_model_len=128, probe_s=10.0, resources={"rlhf_device": 1}, name_prefix="stream-")
    try:
        whole = engine.call("generate", prompts, n=4, seed=11, timeout_s=300)
        # each item: the groups of the prompts one decode step finished, every group whole
        items = [ray.get(ref, timeout=300) for ref in engine.actor.generate_stream.remote(prompts, n=4, seed=11)]
        counts = [sum(c.prompt_index == i for item in items for c in item) for i in range(len(prompts))]
        assert counts == [4] * len(prompts)
        assert all(sum(c.prompt_index == i for c in item) in (0, 4) for item in items for i in range(len(prompts)))
        streamed = sorted((c for item in items for c in item), key=lambda c: c.prompt_index)  # stable: sample order
        assert [(c.prompt_index, c.token_ids, c.finish_reason) for c in streamed] == \
            [(c.prompt_index, c.token_ids, c.finish_reason) for c in whole]
        assert max(abs(a - b) for c, w in zip(streamed, whole) for a, b in zip(c.logp, w.logp)) < 1e-5

        # 512 sequences of 120 tokens (two waves of vLLM's 256): seconds of decoding, every group finishing at
        # its wave's last step; cancelled after 0.5 s, the stream stops at its next step and yields no group
        gen = engine.actor.generate_stream.remote(prompts, n=8, max_tokens=120, ignore_eos=True)
        time.sleep(0.5)
        ray.cancel(gen)
        came = []
        end = time.monotonic() + 120
        while True:
            ready, _ = ray.wait([gen], timeout=max(end - time.monotonic(), 0.0))
            assert ready, "the cancelled stream did not end"
            try:
                came += ray.get(next(gen), timeout=60)
            except StopIteration:
                break
            except Exception:  # the cancelled task's own end
                break
        assert len(came) < len(prompts) * 8, "the cancel was ignored: every group was generated"
        _drain(gen, time.monotonic() + 5)
        # nothing of the stopped generation is left running: the next call serves the same samples as before
        again = engine.call("generate", prompts, n=4, seed=11, timeout_s=300)
        assert [c.token_ids for c in again] == [c.token_ids for c in whole]
    finally:
        engine.call("close", timeout_s=120)
        engine.kill()


def _run(d: Path, out: Path, *extra: str) -> list[dict]:
    cfg = load_run_config(REPO / "configs/tiny_cpu.yaml", [
        f"model.path={d}", f"data.train_files=[{d / 'train.jsonl'}]", f"data.heldout_files=[{d / 'heldout.jsonl'}]",
        f"output_dir={out}", f"tracking.dir={out}", f"checkpoint.dir={out / 'ckpt'}", "checkpoint.export_hf=false",
        # three draws' worth of prompts per step: three waves of vLLM's 256 sequences, so the batch is full (its 32
        # groups with signal, in prompt order) before the last wave's groups come back
        "steps=2", "eval_every=2", "data.gen_prompts_per_step=96", *extra])
    train(cfg)
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def test_streamed_draws_train_on_the_batch_whole_draws_make(tiny, ray_session, tmp_path):
    d, _ = tiny
    whole = _run(d, tmp_path / "whole", "rollout.stream_groups=false")
    # engine 1 killed as step 2's streams go out: replaced, and its share generated again with the same seeds
    streamed = _run(d, tmp_path / "streamed", "rollout.stream_groups=true", "chaos.kill_engines=[1@2]")
    assert len(whole) == len(streamed) == 2
    for w, s in zip(whole, streamed):
        assert w["rollout/groups_stopped"] == 0
        assert {k: s.get(k) for k in SAME} == {k: w.get(k) for k in SAME}
    assert sum(s["rollout/groups_stopped"] for s in streamed) > 0
    assert [s["faults/engine_restarts"] for s in streamed] == [0, 1]
    assert sum(s["rollout/generated_tokens"] for s in streamed) < sum(w["rollout/generated_tokens"] for w in whole)
