"""One small handle type for a role, in process or a Ray actor (docs/architecture.md, "Roles").

The controller submits calls and gathers their results the same way in both placement
modes, so no code path exists only for one of them. `submit` starts a call (a local
call runs at once; a Ray call is sent), `gather` collects several calls with one bound
on the time they may take together. Whatever goes wrong comes back as a `RoleError` that
names the role, the call and the step: a timeout (the role is hung, or a collective
waits for a rank that died), an actor that died, or an exception the role raised, whose
own message is kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class RoleError(RuntimeError):
    """A role failed, hung or died; `kind` is "raised", "timeout" or "died"."""

    def __init__(self, role: str, call: str, step: int | None, kind: str, detail: str):
        where = f" at step {step}" if step is not None else ""
        verb = {"raised": "raised", "timeout": "did not answer", "died": "died during"}[kind]
        if kind == "raised":
            msg = f"{role}: `{call}`{where} raised {detail}"
        elif kind == "timeout":
            msg = f"{role}: `{call}`{where} {verb} within {detail}"
        else:
            msg = f"{role} {verb} `{call}`{where}: {detail}"
        super().__init__(msg)
        self.role, self.call, self.step, self.kind = role, call, step, kind


class RoleDied(RuntimeError):
    """The actor behind an awaited call died (Handle.acall)."""


@dataclass
class Pending:
    """A submitted call: a Ray object ref, a future (a call running on a thread of this process
    or in another process of a launcher's job: tidal/runtime/launcher.py), or the outcome of a
    local call."""

    handle: Handle
    call: str
    ref: Any = None
    value: Any = None
    error: BaseException | None = None
    future: Any = None  # concurrent.futures.Future; RoleDied when the process behind it ended


class Handle:
    """`target` is the role object itself (local) or a Ray actor handle (`remote=True`)."""

    def __init__(self, role: str, target: Any, remote: bool = False):
        self.role, self.target, self.remote = role, target, remote

    def submit(self, call: str, *args, **kwargs) -> Pending:
        if self.remote:
            return Pending(self, call, ref=getattr(self.target, call).remote(*args, **kwargs))
        try:
            return Pending(self, call, value=getattr(self.target, call)(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - reported by gather, as for a remote role
            return Pending(self, call, error=e)

    def call(self, call: str, *args, step: int | None = None, timeout_s: float = 600.0, **kwargs):
        return gather([self.submit(call, *args, **kwargs)], step=step, timeout_s=timeout_s)[0]

    async def acall(self, call: str, *args, timeout_s: float = 600.0):
        """Await one call of a Ray role from asyncio code (the rollout). The role's own
        exception comes back as itself (not Ray's wrapper with its remote traceback); a dead
        actor as `RoleDied`, no answer within `timeout_s` as TimeoutError, both naming the role."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return await asyncio.wait_for(getattr(self.target, call).remote(*args), timeout_s)
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, BaseException) else e.as_instanceof_cause()) from None
        except RayActorError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise RoleDied(f"{self.role} died during {call}: {type(e).__name__}: {first}") from None
        except TimeoutError:
            raise TimeoutError(f"{self.role} did not answer {call} within {timeout_s:g} s") from None

    def kill(self) -> None:
        if self.remote:
            import ray

            ray.kill(self.target, no_restart=True)

    def __repr__(self) -> str:
        return f"Handle({self.role}{', ray' if self.remote else ''})"


def gather(pendings: Sequence[Pending], *, step: int | None = None, timeout_s: float = 600.0) -> list:
    """Results in order. Fails on the first call that fails: a rank that died while the
    others wait in a collective is reported at once, not after their timeout."""
    for p in pendings:
        if p.error is not None:
            raise _role_error(p, step, p.error) from p.error
    futures = [p for p in pendings if p.future is not None]
    if futures:
        _wait_futures(futures, step, timeout_s)
    remote = [p for p in pendings if p.ref is not None]
    if remote:
        import ray

        by_ref = {p.ref: p for p in remote}
        waiting = list(by_ref)
        deadline = time.monotonic() + timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                slow = by_ref[waiting[0]]
                raise RoleError(slow.handle.role, slow.call, step, "timeout", f"{timeout_s:g} s "
                                f"({len(waiting)} of {len(remote)} calls still running)")
            done, waiting = ray.wait(waiting, num_returns=1, timeout=left)
            for ref in done:
                p = by_ref[ref]
                try:
                    p.value = ray.get(ref)
                except Exception as e:
                    raise _role_error(p, step, e) from e
    return [p.value for p in pendings]


FAILURE_GRACE_S = 2.0  # after a first failure, how long the other calls may take to fail too


def _wait_futures(pendings: list[Pending], step: int | None, timeout_s: float) -> None:
    """Their values, or the first failure. A process that ended is the news over a failure it
    caused: its peers' collectives fail as well (gloo: the connection closed), so once one call
    fails the others get FAILURE_GRACE_S to fail, and a died call among them is reported first."""
    from concurrent.futures import ALL_COMPLETED, FIRST_EXCEPTION, wait

    by_future = {p.future: p for p in pendings}
    done, waiting = wait(by_future, timeout=timeout_s, return_when=FIRST_EXCEPTION)
    failed = [by_future[f] for f in done if f.exception() is not None]
    if failed:
        more, _ = wait(waiting, timeout=FAILURE_GRACE_S, return_when=ALL_COMPLETED)
        failed += [by_future[f] for f in more if f.exception() is not None]
        first = next((p for p in failed if isinstance(p.future.exception(), RoleDied)), failed[0])
        raise _role_error(first, step, first.future.exception()) from first.future.exception()
    if waiting:
        slow = next(p for p in pendings if p.future in waiting)
        raise RoleError(slow.handle.role, slow.call, step, "timeout", f"{timeout_s:g} s "
                        f"({len(waiting)} of {len(pendings)} calls still running)")
    for p in pendings:
        p.value = p.future.result()


def _role_error(p: Pending, step: int | None, e: BaseException) -> RoleError:
    if isinstance(e, RoleDied):  # a launcher's process that ended (tidal/runtime/launcher.py)
        return RoleError(p.handle.role, p.call, step, "died", str(e))
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
    except ImportError:  # local mode without Ray installed
        return RoleError(p.handle.role, p.call, step, "raised", f"{type(e).__name__}: {e}")
    if isinstance(e, RayTaskError):  # the role raised: report its own exception, not Ray's wrapper
        cause = e.as_instanceof_cause()
        inner = getattr(e, "cause", None) or cause
        return RoleError(p.handle.role, p.call, step, "raised", f"{type(inner).__name__}: {inner}")
    if isinstance(e, ActorDiedError | ActorUnavailableError | RayActorError):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return RoleError(p.handle.role, p.call, step, "died", f"{type(e).__name__}: {first}")
    return RoleError(p.handle.role, p.call, step, "raised", f"{type(e).__name__}: {e}")
