"""The driver: the single controller of a run (`rlhf train`, `rlhf eval`). The top of the stack: it alone,
with the CLI, wires the roles (`actors`) to the pure layers below.

    loop      the RL step, top to bottom (`train`)
    run       a run's state: inputs checked before any actor starts, roles, phases, checkpoints
    rollout   one step's rollouts: draw prompts, generate groups, score, dynamic sampling
    metrics   a step's metrics from the roles' replies
    evaluate  `rlhf eval`: a policy directory scored with our model and with vLLM
"""

from rlhf.driver.loop import train

__all__ = ["train"]
