"""Automatic recovery from a trainer rank that died: the run restarts its roles from its last
checkpoint and goes on, up to `run.max_restarts` times.

Why a restart of every role, not of the one rank: the ranks share a torch.distributed group,
and a group that lost a member cannot take a new one (every collective of the survivors fails
or waits), the engines hold weights of a step the checkpoint may not have reached, and the
rollout in flight was produced for it. So the whole set of roles is closed and built again,
and the run continues as `tidal train --resume` does: the checkpoint's weights, optimizer,
data position and RNG states, the steps after it trained again (each once in metrics.jsonl
and the episode store, as after any resume). What it costs is the roles' start-up and the
steps since the checkpoint; `run.save_every` bounds the second.

Which failures: a trainer rank that died (its actor is gone) or does not answer (stopped, a
hung collective), and an error a surviving rank raised while another rank is dead (a collective
whose peer vanished). Anything else (a rank that raised on its own, a bad batch, the failure
budget) stops the run as before: a restart would fail the same way. Each restart is an event
in RUN/events.jsonl (`kind: restart`, shown on the dashboard), a warning in train.log and a
line in RUN/resumes.jsonl.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.durable import append_lines
from tidal.runtime.handles import RoleError
from tidal.runtime.run_dir import RunFailed

log = logging.getLogger("tidal")


def dead_ranks(ctl) -> list[str]:
    """The trainer ranks of `ctl` that no longer answer a trivial call within 10 s."""
    dead = []
    for h in getattr(ctl.trainer, "ranks", []):
        if not getattr(h, "remote", False):
            continue
        try:
            h.call("pid", timeout_s=10.0)
        except RoleError:
            dead.append(h.role)
    return dead


def recoverable(e: BaseException, ctl) -> str | None:
    """Why `e` is a trainer-rank loss a restart can mend (the dead ranks), or None."""
    if not isinstance(e, RoleError) or not e.role.startswith("trainer rank"):
        return None
    dead = dead_ranks(ctl)
    if e.kind in ("died", "timeout"):
        return ", ".join(dead) or e.role
    return ", ".join(dead) if dead else None  # a survivor's error because its peer is gone


class Recovering:
    """Trains `ctl`; when a trainer rank is lost and the run has a checkpoint, closes it, logs
    the restart, builds the run again resumed (`rebuild(resume_record)`), and trains on, up to
    cfg.run.max_restarts times. `ctl` is always the controller in use (None while a new one is
    being built): the caller closes it, whatever `train` raised."""

    def __init__(self, ctl, rebuild: Callable[[dict], Any]):
        self.ctl, self.rebuild, self.restarts = ctl, rebuild, 0

    def train(self) -> dict[str, float]:
        while True:
            try:
                return self.ctl.train()
            except RoleError as e:
                ctl = self.ctl
                lost = recoverable(e, ctl)
                limit = ctl.cfg.run.max_restarts
                ckpt = ctl.paths.latest_checkpoint()
                launched = ctl.cfg.placement.mode == "launcher"
                if lost is None or launched or self.restarts >= limit or ckpt is None:
                    if lost is None:
                        raise
                    why = ("placement.mode=launcher: the launcher started the ranks and only it can start them "
                           "again" if launched else f"run.max_restarts={limit} restarts were used"
                           if self.restarts >= limit else "the run has no checkpoint to restart from yet (run.save_every)")
                    log.error("not restarting after losing %s: %s", lost, why)
                    # One message a person can act on (the CLI's exit 3), not the actor's traceback.
                    raise RunFailed(f"{e}; not restarted: {why}. " + (
                        f"The last good checkpoint is {ckpt} (continue with: tidal train --resume "
                        f"run.dir={ctl.paths.root})" if ckpt is not None else
                        "No step was saved: start the run again (a lower run.save_every makes a "
                        "restart possible sooner)")) from e
                self.restarts += 1
                step = e.step if e.step is not None else ctl.step + 1
                message = (f"{lost} lost at step {step} ({e}); restarting every role from {ckpt} "
                           f"(restart {self.restarts} of run.max_restarts={limit})")
                log.warning("%s", message)
                _event(ctl.paths.root, {"kind": "restart", "step": step, "role": lost,
                                        "checkpoint": str(ckpt), "restart": self.restarts, "max_restarts": limit,
                                        "message": message})
                self.ctl = None
                ctl.close()
                self.ctl = self.rebuild({"restart": self.restarts, "reason": str(e)})


def _event(root: Path, event: dict) -> None:
    append_lines(root / "events.jsonl", [json.dumps({**event, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n"])
