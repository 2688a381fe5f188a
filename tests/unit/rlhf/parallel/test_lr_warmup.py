"""Learning-rate schedule: linear warmup over `trainer.lr_warmup_steps`, then constant or a cosine decay
over `trainer.lr_decay_steps`, counted by the optimizer's own step count (which checkpoints carry, so a
resumed run continues the schedule)."""

from types import SimpleNamespace

import pytest
import torch

from rlhf.schema import TrainerConfig
from rlhf.parallel.optim import ShardedAdamW
from rlhf.parallel.trainer import ParallelTrainer


def _schedule(tcfg: TrainerConfig, steps: int):
    """The lr of each of `steps` optimizer steps, and the optimizer that took them."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = ShardedAdamW({"dp": (None, 1, 0, [p])}, lr=1.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    trainer = SimpleNamespace(tcfg=tcfg, optimizer=opt)
    seen = []
    for _ in range(steps):
        lr = ParallelTrainer.current_lr(trainer)
        seen.append(lr)
        opt.set_lr(lr)
        p.grad = torch.ones(3)
        opt.step()
    return seen, opt


def test_warmup_is_linear_then_flat_and_follows_the_optimizer_step_count():
    seen, opt = _schedule(TrainerConfig(lr=1e-3, lr_warmup_steps=4), 6)
    assert seen == [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    assert opt.steps_taken == 6
    assert ParallelTrainer.current_lr(SimpleNamespace(tcfg=TrainerConfig(lr=1e-3), optimizer=opt)) == 1e-3


def test_cosine_decay_after_warmup_reaches_the_floor_and_holds():
    seen, _ = _schedule(TrainerConfig(lr=1e-3, lr_warmup_steps=2, lr_decay_steps=4, lr_min_ratio=0.1), 8)
    # warmup 5e-4, 1e-3; cosine over 4 steps: 1e-3, 1e-4 + 9e-4 * (1 + cos(pi/4)) / 2, 5.5e-4, ...; then 1e-4
    expected = [5e-4, 1e-3, 1e-3, 1e-4 + 9e-4 * (1 + 2 ** -0.5) / 2, 5.5e-4, 1e-4 + 9e-4 * (1 - 2 ** -0.5) / 2, 1e-4, 1e-4]
    assert seen == pytest.approx(expected, rel=1e-12)
