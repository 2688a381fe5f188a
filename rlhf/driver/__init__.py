"""The driver: the single controller of a run (`rlhf train`, `rlhf eval`). The top of the stack: it alone,
with the CLI, wires the roles (`actors`) to the pure layers below.

    loop        the RL step, top to bottom (`train`): generate, then train, then sync
    async_loop  StaleSync (`stale_sync.max_staleness` > 0): the engines generate ahead of the trainer
    step        what both loops share: from a step's rollouts to the weights the engines serve next
    run         a run's state: inputs checked before any actor starts, roles, phases, checkpoints
    faults      dead engines replaced, trainer ranks restarted from a checkpoint, chaos kills (`Run`'s part)
    rollout     one step's rollouts: draw prompts, generate groups, score, dynamic sampling
    metrics     a step's metrics from the roles' replies
    evaluate    `rlhf eval`: a policy directory scored with our model and with vLLM
"""

from rlhf.driver.loop import train

__all__ = ["train"]
