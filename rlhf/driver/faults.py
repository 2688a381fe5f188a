"""What a run does when one of its processes dies (docs/faults.md): the `Faults` component of `Run`, and the
budgets that bound it.

    a rollout engine    replaced on its placement slot, the weight-sync group re-formed, the served weights
                        installed, its work redone (`recover_engines`; StaleSync's producer asks the main
                        thread, `serve_recoveries`), at most rollout.max_restarts in a window of steps
    a trainer or        every trainer and reference rank restarted, the last complete checkpoint restored, the
    reference rank      steps since it redone (`restart_policy`, called by the loop), at most trainer.max_restarts
    a hung engine       (silent to liveness probes, or a call unanswered within rollout.hang_timeout_s, in a
                        generation or a weight sync) killed, then as a dead one
    chaos               the kills and stops `chaos.*` asks for, sent as a phase's calls go out (`_inject`)
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Callable

from actors.remote import RoleError, settle
from actors.replies import SyncReplies
from rlhf.config.chaos import engine_kills, environment_kills, trainer_kills
from rlhf.errors import EngineRestartsExhausted, PolicyRestartRefused
from rlhf.schema import ChaosConfig, RolloutConfig, RunConfig


class Faults:
    """A run's faults: its counts of replacements and restarts, the chaos kills still to come, and the requests
    of other threads for engine replacements, served on the main thread (their own lock). It acts on its
    run (`rlhf.driver.run.Run`: roles, weights, phases, checkpoints); `wake` wakes the main thread where it
    may be waiting on another condition (the rollout source's)."""

    def __init__(self, run, wake: Callable[[], None] = lambda: None):
        self.run, self.wake = run, wake
        self.engine_restarts: list[int] = []  # the step of each engine replacement
        self.trainer_restarts = 0  # times every trainer and reference rank was restarted from a checkpoint
        self.steps_redone = 0  # steps done again after those restarts
        self.kills = chaos_kills(run.cfg.chaos)  # still to inject: (step, role, index, phase)
        self.posted_sync: list = []  # the references of a sync posted with an update that failed
        self.producer_batch = 0  # the batch another thread generates (where its generation's kills land)
        # Engine replacement asked for by another thread (StaleSync's producer) is done by this one, the driver's
        # main thread, where it knows the trainer idle (`serve_recoveries`).
        self.main_thread = threading.current_thread()
        self.cv = threading.Condition()
        self.requests: list[dict] = []
        self.closed = False

    def metrics(self) -> dict:
        return {"faults/engine_restarts": len(self.engine_restarts), "faults/trainer_restarts": self.trainer_restarts,
                "faults/steps_redone": self.steps_redone}

    def producing(self, batch: int) -> None:
        """Another thread generates `batch` now: chaos kills of that batch's generation land in it."""
        self.producer_batch = batch

    def update_failed(self, posted: list) -> None:
        """The update failed with a sync posted behind it (its references): settled where the ranks restart."""
        self.posted_sync = posted

    def sync_weights(self, version: int, posted=None) -> SyncReplies:
        """The weight sync of `version` to every engine; an engine that died before or during it, or hung in it
        (silent to liveness probes, or its receive unanswered by the call's deadline), is replaced
        (`recover_engines`) and the sync done again, to all. `posted`: its calls, sent with the update
        (`Roles.submit_sync(..., posted=True)`)."""
        try:
            return self.run.weights.send(self.run.roles, version, posted)
        except RoleError as e:
            # The peers of a dead engine fail at once (a closed connection) or wait in a receive that the
            # group's re-forming releases (its members leave the old group first); not their timeout. The
            # peers of a hung one are released when it is killed (its connections close).
            settle(e.pending, 2.0)
            dead = self.run.roles.dead_engines()
            if not dead and e.hung and e.role == "rollout":
                dead = [e.rank]
            if not dead:
                raise
            sync = self.recover_engines(dead, str(e), version=version)
            settle(e.pending, 0.0)  # ended now: their errors read, not reported by Ray as unhandled
            return sync

    def recover_engines(self, dead: list[int], why: str, handles: list | None = None,
                        version: int | None = None) -> SyncReplies | None:
        """Replace the dead engines on their placement slots, re-form the weight-sync group and install
        `version` (default: what the others serve) in every engine, checksummed as every sync is. Refused once
        rollout.max_restarts replacements fall within the last rollout.restart_window_steps steps. `handles`:
        the engines that died, as the caller called them (one replaced meanwhile is not replaced again).
        Called from another thread (StaleSync's producer), it asks the main thread and waits."""
        if threading.current_thread() is not self.main_thread:
            return self._ask_main(dead, why, handles)
        run = self.run
        if handles is not None:
            dead = [k for k, h in zip(dead, handles) if run.roles.engines[k] is h]
            if not dead:
                return None
        refused = restart_refusal(self.engine_restarts, run.at_step, dead, why, run.cfg.rollout)
        if refused:
            raise EngineRestartsExhausted(refused)
        step = run.at_step
        version = run.roles.version if version is None else version
        run.log(f"step {step}: rollout engine(s) {dead} failed ({why}); replacing them and installing weights "
                f"version {version}")
        with run.phase("engine restart", step):
            run.roles.replace_engines(dead)
            sync = run.weights.send(run.roles, version)
            if run.devices.trainer_offloaded:  # sending onloaded the trainer: back to the engines' turn
                run.roles.all(run.roles.trainer, "offload")
        self.engine_restarts += [step] * len(dead)
        run.log(f"step {step}: engine(s) {dead} replaced and serving version {version} "
                f"({len(self.engine_restarts)} replacement(s) in the run)")
        return sync

    def _ask_main(self, dead: list[int], why: str, handles: list | None) -> None:
        request = {"dead": dead, "why": why, "handles": handles, "done": False, "error": None}
        with self.cv:
            if self.closed:
                raise EngineRestartsExhausted(f"rollout engine(s) {dead} died ({why}) as the run was stopping")
            self.requests.append(request)
        self.wake()
        with self.cv:
            while not request["done"]:
                if self.closed:
                    raise EngineRestartsExhausted(f"rollout engine(s) {dead} died ({why}); the run stopped before "
                                                  "they were replaced")
                self.cv.wait(1.0)
        if request["error"] is not None:
            raise request["error"]

    def recovery_pending(self) -> bool:
        with self.cv:
            return bool(self.requests)

    def serve_recoveries(self) -> None:
        """Main thread, trainer idle (its weights the engines' version): replace the engines other threads
        found dead, and let them go on."""
        with self.cv:
            requests, self.requests = self.requests, []
        error = None
        for request in requests:
            try:
                self.recover_engines(request["dead"], request["why"], request["handles"])
            except BaseException as e:  # told to the asking thread, and raised here: the run stops
                request["error"] = error = e
            with self.cv:
                request["done"] = True
                self.cv.notify_all()
        if error is not None:
            raise error

    def close_recoveries(self) -> None:
        """No more replacements: threads waiting for one raise."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def inject(self, phase: str) -> None:
        """chaos: kill the engines and trainer ranks due at this step and phase (`Roles` calls it with its
        phase, or the method it fans out), their calls just sent."""
        phase = {"send_weights": "sync", "env_step": "step", "env_reset": "reset"}.get(phase, phase)
        roles = self.run.roles
        at = self.run.at_step if threading.current_thread() is self.main_thread else self.producer_batch
        for kill in [k for k in self.kills if k[0] == at and k[3] == phase]:
            self.kills.remove(kill)
            step, role, index, _ = kill
            if role == "stop rollout":  # alive and never answering: found by its liveness probes
                self.run.log(f"step {step}: chaos: stopping rollout rank {index} during {phase} (SIGSTOP)")
                os.kill(_actor_process(roles.engine_pids[index], "VLLMEngine", f"rollout engine {index}"),
                        signal.SIGSTOP)
                continue
            if role == "stop trainer":
                self.run.log(f"step {step}: chaos: stopping trainer rank {index} during {phase} (SIGSTOP)")
                os.kill(_actor_process(roles.policy_pids[index], "TrainerWorker", f"trainer rank {index}"),
                        signal.SIGSTOP)
                continue
            self.run.log(f"step {step}: chaos: killing {role} rank {index} during {phase}")
            {"rollout": roles.engines, "environment": roles.environments}.get(role, roles.trainer)[index].kill()

    def restart_policy(self, e: RoleError) -> None:
        """A trainer or reference rank died: every such rank started again, the last complete checkpoint
        restored (weights, optimizer, data cursor, RNG) and synced to the engines, so the loop goes on from
        the step after it; the run's record of the steps since then is dropped (they are redone). Refused
        past trainer.max_restarts, or with no checkpoint to restore."""
        run = self.run
        ckpt = run.last_checkpoint or run.inputs.resume_dir
        refused = policy_restart_refusal(e, ckpt, self.trainer_restarts, run.cfg, self._policy_log(e))
        if refused:
            raise PolicyRestartRefused(refused) from e
        failed_step = run.at_step
        run.log(f"step {failed_step}: {e}; restarting every trainer and reference rank from {ckpt}")
        with run.phase("trainer restart", failed_step):
            run.roles.restart_policy()
            settle(self.posted_sync, 10.0)  # a sync posted with the failed update: its receives end with the old ranks
            self.posted_sync = []
            run.resume(ckpt)  # the trainer offloaded: the engines' turn, as at the start of a step
            run.devices.wake_engines(run.roles)
        # the failed step's phases are not the redone step's; the restart is reported with the first step redone
        run.recorder.redo_after(run.step)
        self.trainer_restarts += 1
        self.steps_redone += failed_step - 1 - run.step
        run.log(f"step {failed_step}: trainer restarted ({self.trainer_restarts} in the run); steps {run.step + 1}.."
                f"{failed_step - 1} are redone")

    def dead_policy_rank(self, e: RoleError) -> RoleError | None:
        """The death or hang of a trainer or reference rank behind `e`, as a RoleError naming that rank: `e`
        itself, or (when a peer's failure came first: a closed connection, a collective timing out) the dead
        rank a probe finds, else the rank silent to its liveness probes. None: every policy rank is alive and
        answers (a failure a restart would not mend: the run stops)."""
        if policy_died(e):
            return e
        settle(e.pending, 2.0)
        h = self.run.roles.dead_policy_rank()
        if h is not None:
            return RoleError(h.role, h.rank, e.method, f"failed: the actor died (seen as: {e})", died=True)
        if e.hung and e.role in ("trainer", "reference"):
            return e
        h = self.run.roles.silent_policy_rank()
        return None if h is None else RoleError(h.role, h.rank, e.method, "hung: its process answered no liveness "
                                                f"probe in {h.probe_s:.0f} s (seen as: {e})", hung=True)

    def _policy_log(self, e: RoleError) -> list[str]:
        """The last lines the dead rank's process wrote (Ray keeps them on its node: local runs only)."""
        import glob

        roles = self.run.roles
        pids = roles.policy_pids
        group = roles.trainer if e.role == "trainer" else roles.reference
        i = e.rank + (len(roles.trainer) if e.role == "reference" else 0)
        if i >= len(pids) or e.rank >= len(group):
            return []
        files = glob.glob(f"/tmp/ray/session_latest/logs/worker-*-{pids[i]}.err")
        try:
            lines = Path(files[0]).read_text(errors="replace").splitlines() if files else []
        except OSError:
            return []
        return [line for line in lines if line.strip() and not line.startswith(":")][-8:]  # ":job_id:" etc. are Ray's


def chaos_kills(c: ChaosConfig) -> list[tuple]:
    """The kills and stops `chaos.*` asks for: (step, role, index, phase) each."""
    return ([(s, "rollout", k, ph) for s, k, ph in engine_kills(c.kill_engines)]
            + [(s, "stop rollout", k, ph) for s, k, ph in engine_kills(c.stop_engines)]
            + [(s, "trainer", r, ph) for s, r, ph in trainer_kills(c.kill_trainer_ranks)]
            + [(s, "stop trainer", r, ph) for s, r, ph in trainer_kills(c.stop_trainer_ranks)]
            + [(s, "environment", w, ph) for s, w, ph in environment_kills(c.kill_environment_workers)])


def policy_died(e: BaseException) -> bool:
    """A trainer or reference rank's process is gone (as opposed to: it raised, or hangs)."""
    return isinstance(e, RoleError) and e.died and e.role in ("trainer", "reference")


def policy_restart_refusal(e: RoleError, ckpt: Path | None, restarts: int, cfg: RunConfig,
                           last_lines: list[str]) -> str | None:
    """Why a dead trainer or reference rank does not lead to a restart (None: it does)."""
    if ckpt is not None and restarts < cfg.trainer.max_restarts:
        return None
    why = ("no complete checkpoint to restart from (set checkpoint.every_steps to save one)" if ckpt is None else
           f"trainer.max_restarts={cfg.trainer.max_restarts} restart(s) already made")
    tail = "".join(f"\n    {line}" for line in last_lines)
    resume = (f"rlhf train RUN.yaml checkpoint.dir={cfg.checkpoint.dir} checkpoint.resume=auto" if ckpt is not None
              else "rlhf train RUN.yaml (from the start: nothing was saved)")
    return (f"{e.role} rank {e.rank} {'hung' if e.hung else 'died'} at {e.method} ({e}); {why}: stopping. Its last "
            "log lines:"
            f"{tail or ' (none found under /tmp/ray/session_latest/logs)'}\n  resume with: {resume}")


def restart_refusal(restarts: list[int], step: int, dead: list[int], why: str, r: RolloutConfig) -> str | None:
    """Why replacing the `dead` engines at `step` is refused (None: it is not), given the steps of the run's
    earlier replacements: at most rollout.max_restarts within the last rollout.restart_window_steps steps."""
    recent = [s for s in restarts if s > step - r.restart_window_steps]
    if len(recent) + len(dead) <= r.max_restarts:
        return None
    return (f"rollout engine(s) {dead} died at step {step} ({why}); {len(recent)} engine replacement(s) in the last "
            f"{r.restart_window_steps} steps, and rollout.max_restarts={r.max_restarts} allows no more: stopping. "
            f"The engines' logs are under /tmp/ray/session_latest/logs (actor rollout-<k>); resume from the last "
            f"checkpoint with checkpoint.resume=auto")


def _actor_process(pid: int, cls: str, what: str) -> int:
    """`pid` if it is the process of an actor of class `cls` on this machine; chaos.stop_* signals it from here,
    so an actor on another node (whose pid means nothing here) is refused, never some local process."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        title = ""
    if cls not in title:
        raise ValueError(f"chaos: {what} (pid {pid}) is not a process on the driver's machine; stop processes "
                         "only in runs whose actors share the driver's machine")
    return pid
