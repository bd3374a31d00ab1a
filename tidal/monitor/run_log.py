"""The run's train.log: the console's step lines and sample tables, tidal's messages (failed
episodes with their tracebacks, hacking events, ...), Python warnings of any library, and the
traceback of an error that stops the run."""

from __future__ import annotations

import logging
from pathlib import Path


class RunLogHandler(logging.FileHandler):
    """The run's train.log. Writing to it never raises into the code that logged: a handler
    left open by a controller nobody closed, whose run directory is gone, reports the failure
    on stderr (logging's handleError) instead of failing the next run's start."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)
        except OSError:
            self.handleError(record)


class RunLog:
    """Open while the run is: handlers on the `tidal` and `py.warnings` loggers (warnings
    captured unless the program routes them itself), and `file`, a logger that writes to
    train.log only (the console sink's lines, printed by the sink itself; the stopping error's
    traceback, which the caller reports on the console in short)."""

    def __init__(self, path: Path):
        self.handler = RunLogHandler(path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        tidal_log = logging.getLogger("tidal")
        self.handlers: list[logging.Handler] = [self.handler]
        if not logging.getLogger().handlers and not tidal_log.handlers:
            # Nobody configured logging: warnings still reach the console (as Python's last
            # resort would print them, which a handler on "tidal" would otherwise silence).
            console = logging.StreamHandler()
            console.setLevel(logging.WARNING)
            self.handlers.append(console)
        self.captured_warnings = not logging.getLogger("py.warnings").handlers
        if self.captured_warnings:
            logging.captureWarnings(True)
        for name in ("tidal", "py.warnings"):
            for h in self.handlers:
                logging.getLogger(name).addHandler(h)
        if tidal_log.getEffectiveLevel() > logging.INFO:
            tidal_log.setLevel(logging.INFO)
        self.file = logging.getLogger("tidal.run_log")
        self.file.propagate = False
        self.file.setLevel(logging.INFO)
        self.file.addHandler(self.handler)

    def close(self) -> None:
        """Idempotent: the loop and close() both end the log."""
        if not self.handlers:
            return
        for h in self.handlers:
            for name in ("tidal", "py.warnings"):
                logging.getLogger(name).removeHandler(h)
            h.close()
        self.file.removeHandler(self.handler)
        if self.captured_warnings:
            logging.captureWarnings(False)
        self.handlers = []
