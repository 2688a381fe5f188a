"""A hung collective times out instead of stalling the run: one trainer rank stops taking part (alive, but
busy elsewhere, as a rank stuck in I/O or a deadlocked thread would be); its peer's update raises within
`trainer.collective_timeout_s`, naming its rank, the phase and the setting."""

import time

from rlhf.sharding.layout import Layout
from rlhf.parallel.launch import run_ranks
from rlhf.parallel.trainer import ParallelTrainer
from rlhf.schema import TrainerConfig
from tests.dist.test_trainer import CFG, TCFG, loss_fn, make_batch, micro_batches, model_dir  # noqa: F401

TIMEOUT_S = 3.0


def worker(rank, layout, path):
    tr = ParallelTrainer(CFG, TrainerConfig(**(TCFG.__dict__ | {"collective_timeout_s": TIMEOUT_S})), layout, rank,
                         path)
    ids, attn, adv = make_batch()
    mbs = micro_batches(ids, attn, adv, range(rank, 8, layout.dp))
    tr.train_step(mbs, loss_fn)  # both ranks together: the group works
    if rank == 1:
        time.sleep(4 * TIMEOUT_S)  # stalls: never joins the next step's collectives
        return {"stalled": True}
    t0 = time.monotonic()
    try:
        tr.train_step(mbs, loss_fn)
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def test_a_stalled_peer_surfaces_as_a_timeout_within_the_configured_bound(model_dir):  # noqa: F811
    layout = Layout(dp=2, ep=2)  # the expert all-to-all is the first collective the step needs
    waiting, stalled = run_ranks(worker, 2, layout, str(model_dir), timeout_s=240, collective_timeout_s=TIMEOUT_S)
    assert stalled == {"stalled": True}
    assert waiting["error"].startswith("trainer rank 0: forward and backward (expert all-to-all"), waiting
    assert "trainer.collective_timeout_s=3 s; a peer rank stopped taking part" in waiting["error"]
    assert TIMEOUT_S * 0.9 <= waiting["seconds"] <= TIMEOUT_S + 10, waiting
