"""A watchdog for the local Ray instance a run starts: when the driver dies without closing it
(kill -9, the OOM killer), it ends the processes that instance's raylet started.

Why it is needed: Ray ties its GCS and raylet to the driver (PR_SET_PDEATHSIG, SIGKILL), and an
actor's worker leaves within seconds of its raylet; but the raylet's agents (the dashboard agent,
the runtime-env agent), finding their raylet killed rather than stopped, first publish an error to
the GCS, which died with it, under a fixed 60 s timeout (Ray 2.60,
ray/_private/process_watcher.py): measured here, they outlived a killed driver by 62 s.

How: a small process in its own session reads a pipe from the driver, and every second notes
the raylet's children (pid and start time). End of file without `done` means the driver died:
it then sends SIGTERM, and after 1 s SIGKILL, to those children that are still the same
processes and to every process whose environment names the raylet (`RAY_RAYLET_PID=<pid>`,
which Ray gives the processes the raylet starts: agents and workers; measured, the environment
alone missed the agents in 3 of 6 runs). A driver that closes Ray itself writes `done` first
and the watchdog leaves quietly. Only for an instance the run started (never a cluster it joined).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time


def start(raylet_pid: int) -> subprocess.Popen:
    """The watchdog of the raylet `raylet_pid`, watching this process."""
    return subprocess.Popen([sys.executable, "-m", "tidal.runtime.ray_watchdog", str(raylet_pid)],
                            stdin=subprocess.PIPE, start_new_session=True)  # a Ctrl-C to the run's group spares it


def stop(proc: subprocess.Popen | None) -> None:
    """The driver closed Ray itself: the watchdog leaves without ending anything."""
    if proc is None:
        return
    with contextlib.suppress(OSError):
        proc.stdin.write(b"done\n")
        proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _stat(pid: int | str) -> tuple[int, str] | None:
    """(parent pid, start time) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[19]


def children(ppid: int) -> dict[int, str]:
    """The processes whose parent is `ppid`, with their start times (to tell a reused pid)."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(name)) is not None and st[0] == ppid:
            out[int(name)] = st[1]
    return out


def started_by(raylet_pid: int) -> list[int]:
    """The processes whose environment names `raylet_pid` as their raylet."""
    mark = f"RAY_RAYLET_PID={raylet_pid}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if mark in env:
            found.append(int(name))
    return found


def _targets(raylet_pid: int, known: dict[int, str]) -> list[int]:
    """What to end: the raylet's children seen while it lived (still the same processes) and
    every process whose environment names it (a process that rewrote its title may have lost
    that environment view, hence both)."""
    same = [pid for pid, start in known.items() if (st := _stat(pid)) is not None and st[1] == start]
    return sorted(set(same) | set(started_by(raylet_pid)))


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def main(argv: list[str]) -> int:
    raylet_pid = int(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    known: dict[int, str] = {}  # the raylet's children, looked at every second while the driver lives
    told = b""
    fd = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            known.update(children(raylet_pid))
            continue
        data = os.read(fd, 4096)
        told += data
        if b"done" in told:
            return 0
        if not data:  # end of file without `done`: the driver died
            break
    pids = _targets(raylet_pid, known)
    print(f"tidal ray_watchdog: the driver ended without closing Ray; ending the {len(pids)} processes of raylet "
          f"{raylet_pid}: {pids}", file=sys.stderr, flush=True)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(_stat(p) is not None for p in pids):
        time.sleep(0.1)
    _signal_all([p for p in _targets(raylet_pid, known) if _stat(p) is not None], signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
