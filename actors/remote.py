"""Spawning role classes as Ray actors, and calling them with a deadline.

Role classes are plain Python classes (testable without Ray); they become actors here. Every remote
call goes through `call`, which waits at most `timeout_s` and turns a worker exception or a timeout
into a `RoleError` naming the role and rank, so the driver never hangs on a dead or stuck actor.
"""

from __future__ import annotations

from typing import Any


class RoleError(RuntimeError):
    """A remote call to a role failed or timed out; names the role, rank and method."""

    def __init__(self, role: str, rank: int, method: str, why: str):
        super().__init__(f"{role} rank {rank}: {method} {why}")
        self.role, self.rank, self.method = role, rank, method


class RoleHandle:
    """An actor plus the role and rank it plays, for error messages."""

    def __init__(self, actor, role: str, rank: int):
        self.actor, self.role, self.rank = actor, role, rank

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def call(self, method: str, *args, timeout_s: float = 300.0, **kwargs) -> Any:
        import ray

        ref = getattr(self.actor, method).remote(*args, **kwargs)
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            try:
                ray.cancel(ref)  # best effort; a stuck actor is killed and replaced by its owner (`kill`)
            except Exception:
                pass
            raise RoleError(self.role, self.rank, method, f"did not answer within {timeout_s:.0f} s") from None
        except ray.exceptions.RayActorError as e:
            raise RoleError(self.role, self.rank, method, f"failed: the actor died ({str(e).splitlines()[0]})") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise RoleError(self.role, self.rank, method, f"raised {type(cause).__name__}: "
                            f"{str(cause).splitlines()[0] if str(cause) else ''}") from cause


def spawn(cls, role: str, rank: int, *args, num_cpus: float = 1, resources: dict | None = None,
          placement_group=None, bundle_index: int | None = None, **kwargs) -> RoleHandle:
    """Start `cls(*args, **kwargs)` as a Ray actor (in a placement-group bundle when given)."""
    import ray

    options: dict = {"num_cpus": num_cpus, "name": f"{role}-{rank}", "max_restarts": 0}
    if resources:
        options["resources"] = resources
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index)
    actor = ray.remote(cls).options(**options).remote(*args, **kwargs)
    return RoleHandle(actor, role, rank)
