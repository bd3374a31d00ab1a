"""Whether a run is running, finished or failed, from its directory alone: the dashboard shows it.

Two files say it. `RUN/run.lock` names the live process while a run holds it (pid, host, start;
tidal/runtime/run_lock.py) and is emptied when the run releases it. `RUN/exit.json` is written by
`tidal train` as it ends: its exit code, a state (finished, failed, interrupted) and the message
that stopped it; a new attempt (a resume) removes it as it takes the lock.

The choice: the reader never takes the lock, not even for a moment (a run starting in that moment
would be refused as if another run held it); it reads the file and asks the kernel whether the
process it names is alive (on this host; on another host the file is taken at its word).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

EXIT_FILE, LOCK_FILE = "exit.json", "run.lock"
STATES = {0: "finished", 2: "failed", 3: "failed", 130: "interrupted", 143: "interrupted"}


def write_exit(root: Path, code: int, message: str = "") -> None:
    """Record how `tidal train` ended, in RUN/exit.json (written whole, then renamed)."""
    record = {"exit_code": code, "state": STATES.get(code, "failed"), "message": message[:2000],
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = root / f".{EXIT_FILE}.tmp"
    with contextlib.suppress(OSError):  # a full disk: the run's own error says so; the status is lost
        tmp.write_text(json.dumps(record) + "\n")
        tmp.replace(root / EXIT_FILE)


def clear_exit(root: Path) -> None:
    (root / EXIT_FILE).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_status(root: Path) -> dict[str, Any]:
    """`{"state": running | finished | failed | interrupted | ended | unknown, ...}`: with the
    holder (pid, host, started) while running, the exit code and message once it ended."""
    holder = _read_json(root / LOCK_FILE)
    if holder.get("pid") is not None:
        here = holder.get("host") == socket.gethostname()
        if not here or _alive(int(holder["pid"])):
            return {"state": "running", "pid": holder["pid"], "host": holder.get("host"),
                    "started": holder.get("started"), **({} if here else {"note": "on another host: not checked"})}
        return {"state": "ended", "pid": holder["pid"], "message": f"process {holder['pid']} ended without "
                "releasing the run (killed, or its machine stopped): no exit code was recorded"}
    ended = _read_json(root / EXIT_FILE)
    if ended:
        return {"state": ended.get("state", "failed"), "exit_code": ended.get("exit_code"),
                "message": ended.get("message", ""), "time": ended.get("time")}
    return {"state": "unknown", "message": "no exit record (a run started by code rather than `tidal train`, or "
            "from before exit records)"}
