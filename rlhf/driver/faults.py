"""What a run does when one of its processes dies (docs/faults.md): the `Recovery` part of `Run`, and the
budgets that bound it.

    a rollout engine    replaced on its placement slot, the weight-sync group re-formed, the served weights
                        installed, its work redone (`recover_engines`; StaleSync's producer asks the main
                        thread, `serve_recoveries`), at most rollout.max_restarts in a window of steps
    a trainer or        every trainer and reference rank restarted, the last complete checkpoint restored, the
    reference rank      steps since it redone (`restart_policy`, synchronous loop), at most trainer.max_restarts
    a hung engine       (silent to liveness probes, or a call unanswered within rollout.hang_timeout_s, in a
                        generation or a weight sync) killed, then as a dead one
    chaos               the kills and stops `chaos.*` asks for, sent as a phase's calls go out (`_inject`)
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from actors.remote import RoleError, settle
from actors.replies import SyncReplies
from rlhf.errors import EngineRestartsExhausted, PolicyRestartRefused
from rlhf.schema import RolloutConfig, RunConfig


class Recovery:
    """Mixed into `rlhf.driver.run.Run`, whose fields it uses (roles, inputs, cfg, the fault counters)."""

    def sync_weights(self, version: int, posted=None) -> SyncReplies:
        """The weight sync of `version` to every engine; an engine that died before or during it, or hung in it
        (silent to liveness probes, or its receive unanswered by the call's deadline), is replaced
        (`recover_engines`) and the sync done again, to all. `posted`: its calls, sent with the update
        (`Roles.submit_sync(..., posted=True)`)."""
        try:
            return self.roles.sync_weights(self.inputs.sync, version, self.inputs.same_device, posted)
        except RoleError as e:
            if self.roles.recover is None:
                raise
            # The peers of a dead engine fail at once (a closed connection) or wait in a receive that the
            # group's re-forming releases (its members leave the old group first); not their timeout. The
            # peers of a hung one are released when it is killed (its connections close).
            settle(e.pending, 2.0)
            dead = self.roles.dead_engines()
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
        if handles is not None:
            dead = [k for k, h in zip(dead, handles) if self.roles.engines[k] is h]
            if not dead:
                return None
        refused = restart_refusal(self.engine_restarts, self.at_step, dead, why, self.cfg.rollout)
        if refused:
            raise EngineRestartsExhausted(refused)
        step = self.at_step
        version = self.roles.version if version is None else version
        self.log(f"step {step}: rollout engine(s) {dead} failed ({why}); replacing them and installing weights "
                 f"version {version}")
        with self.phase("engine restart", step):
            self.roles.replace_engines(dead)
            sync = self.roles.sync_weights(self.inputs.sync, version, self.inputs.same_device)
            if self.trainer_offloaded:  # sending onloaded the trainer: back to the engines' turn
                self.roles.all(self.roles.trainer, "offload")
        self.engine_restarts += [step] * len(dead)
        self.log(f"step {step}: engine(s) {dead} replaced and serving version {version} "
                 f"({len(self.engine_restarts)} replacement(s) in the run)")
        return sync

    def _ask_main(self, dead: list[int], why: str, handles: list | None) -> None:
        request = {"dead": dead, "why": why, "handles": handles, "done": False, "error": None}
        with self.recovery_cv:
            if self.recovery_closed:
                raise EngineRestartsExhausted(f"rollout engine(s) {dead} died ({why}) as the run was stopping")
            self.recovery_requests.append(request)
        self.wake_main()
        with self.recovery_cv:
            while not request["done"]:
                if self.recovery_closed:
                    raise EngineRestartsExhausted(f"rollout engine(s) {dead} died ({why}); the run stopped before "
                                                  "they were replaced")
                self.recovery_cv.wait(1.0)
        if request["error"] is not None:
            raise request["error"]

    def recovery_pending(self) -> bool:
        with self.recovery_cv:
            return bool(self.recovery_requests)

    def serve_recoveries(self) -> None:
        """Main thread, trainer idle (its weights the engines' version): replace the engines other threads
        found dead, and let them go on."""
        with self.recovery_cv:
            requests, self.recovery_requests = self.recovery_requests, []
        error = None
        for request in requests:
            try:
                self.recover_engines(request["dead"], request["why"], request["handles"])
            except BaseException as e:  # told to the asking thread, and raised here: the run stops
                request["error"] = error = e
            with self.recovery_cv:
                request["done"] = True
                self.recovery_cv.notify_all()
        if error is not None:
            raise error

    def close_recoveries(self) -> None:
        """No more replacements: threads waiting for one raise."""
        with self.recovery_cv:
            self.recovery_closed = True
            self.recovery_cv.notify_all()

    def _inject(self, phase: str) -> None:
        """chaos: kill the engines and trainer ranks due at this step and phase (`Roles` calls it with its
        phase, or the method it fans out), their calls just sent."""
        phase = {"send_weights": "sync"}.get(phase, phase)
        at = self.at_step if threading.current_thread() is self.main_thread else self.producer_batch
        for kill in [k for k in self.kills if k[0] == at and k[3] == phase]:
            self.kills.remove(kill)
            step, role, index, _ = kill
            if role == "stop rollout":  # alive and never answering: found by its liveness probes
                self.log(f"step {step}: chaos: stopping rollout rank {index} during {phase} (SIGSTOP)")
                os.kill(_actor_process(self.roles.engine_pids[index], "VLLMEngine", f"rollout engine {index}"),
                        signal.SIGSTOP)
                continue
            if role == "stop trainer":
                self.log(f"step {step}: chaos: stopping trainer rank {index} during {phase} (SIGSTOP)")
                os.kill(_actor_process(self.roles.policy_pids[index], "TrainerWorker", f"trainer rank {index}"),
                        signal.SIGSTOP)
                continue
            self.log(f"step {step}: chaos: killing {role} rank {index} during {phase}")
            (self.roles.engines if role == "rollout" else self.roles.trainer)[index].kill()

    def restart_policy(self, e: RoleError) -> None:
        """A trainer or reference rank died: every such rank started again, the last complete checkpoint
        restored (weights, optimizer, data cursor, RNG) and synced to the engines, so the loop goes on from
        the step after it; the run's record of the steps since then is dropped (they are redone). Refused
        past trainer.max_restarts, or with no checkpoint to restore."""
        ckpt = self.last_checkpoint or self.inputs.resume_dir
        refused = policy_restart_refusal(e, ckpt, self.trainer_restarts, self.cfg, self._policy_log(e))
        if refused:
            raise PolicyRestartRefused(refused) from e
        failed_step = self.at_step
        self.log(f"step {failed_step}: {e}; restarting every trainer and reference rank from {ckpt}")
        with self.phase("trainer restart", failed_step):
            self.roles.restart_policy()
            settle(self.posted_sync, 10.0)  # a sync posted with the failed update: its receives end with the old ranks
            self.posted_sync = []
            self._resume(ckpt)  # the trainer offloaded: the engines' turn, as at the start of a step
            if self.engines_asleep:
                self.roles.all(self.roles.engines, "wake_up")
                self.engines_asleep = False
        # the failed step's phases are not the redone step's; the restart is reported with the first step redone
        self.phase_seconds = {"trainer restart": self.phase_seconds["trainer restart"]}
        self.trainer_restarts += 1
        self.steps_redone += failed_step - 1 - self.step
        self.history = [h for h in self.history if h["step"] <= self.step]
        kept = [i for i, (s, _) in enumerate(self.accuracy) if s <= self.step]
        self.accuracy = [self.accuracy[i] for i in kept]
        self.accuracy_seconds = [self.accuracy_seconds[i] for i in kept]
        self.log(f"step {failed_step}: trainer restarted ({self.trainer_restarts} in the run); steps {self.step + 1}.."
                 f"{failed_step - 1} are redone")

    def dead_policy_rank(self, e: RoleError) -> RoleError | None:
        """The death or hang of a trainer or reference rank behind `e`, as a RoleError naming that rank: `e`
        itself, or (when a peer's failure came first: a closed connection, a collective timing out) the dead
        rank a probe finds, else the rank silent to its liveness probes. None: every policy rank is alive and
        answers (a failure a restart would not mend: the run stops)."""
        if policy_died(e):
            return e
        settle(e.pending, 2.0)
        h = self.roles.dead_policy_rank()
        if h is not None:
            return RoleError(h.role, h.rank, e.method, f"failed: the actor died (seen as: {e})", died=True)
        if e.hung and e.role in ("trainer", "reference"):
            return e
        h = self.roles.silent_policy_rank()
        return None if h is None else RoleError(h.role, h.rank, e.method, "hung: its process answered no liveness "
                                                f"probe in {h.probe_s:.0f} s (seen as: {e})", hung=True)

    def _policy_log(self, e: RoleError) -> list[str]:
        """The last lines the dead rank's process wrote (Ray keeps them on its node: local runs only)."""
        import glob

        pids = self.roles.policy_pids
        group = self.roles.trainer if e.role == "trainer" else self.roles.reference
        i = e.rank + (len(self.roles.trainer) if e.role == "reference" else 0)
        if i >= len(pids) or e.rank >= len(group):
            return []
        files = glob.glob(f"/tmp/ray/session_latest/logs/worker-*-{pids[i]}.err")
        try:
            lines = Path(files[0]).read_text(errors="replace").splitlines() if files else []
        except OSError:
            return []
        return [line for line in lines if line.strip() and not line.startswith(":")][-8:]  # ":job_id:" etc. are Ray's


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
