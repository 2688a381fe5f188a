"""The driver: the single controller of a run (`rlhf train`, `rlhf eval`). The top of the stack: it alone,
with the CLI, wires the roles (`actors`) to the pure layers below.

    loop        the RL loop (`train`): each step's batch from a rollout source, then train, sync, evaluate,
                checkpoint, record; restarts after a dead trainer rank, whatever the source
    sources     rollout sources: the interface, and `Collect` (each step generates its own batch)
    stale_sync  the StaleSync source (`stale_sync.max_staleness` > 0): a producer thread ahead of the trainer
    step        the learning half of a step: from its rollouts to the weights the engines serve next
    run         a run's inputs (checked before any actor starts) and its state, in components:
    record        each step's metrics, the phases, the accuracy history, the result
    faults        dead engines replaced, trainer ranks restarted from a checkpoint, chaos kills
    expert_balance  expert-load balancing (EDPB): the load prediction and the placements it leads to
    turns       the devices' turns where StaleSync's engines and the trainer share devices
    rollout     one step's rollouts: draw prompts, generate groups, score, dynamic sampling
    metrics     a step's metrics from the roles' replies
    evaluate    `rlhf eval`: a policy directory scored with our model and with vLLM
"""

from rlhf.driver.loop import train

__all__ = ["train"]
