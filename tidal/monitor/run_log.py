"""The run's train.log: the console's step lines and sample tables, tidal's messages (failed
episodes with their tracebacks, hacking events, ...), Python warnings of any library, and the
traceback of an error that stops the run."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

from tidal.durable import disk_error, named


class RunLogHandler(logging.FileHandler):
    """The run's train.log. Writing to it never raises into the code that logged. A disk error
    (a full disk: tidal/durable.py) is kept in `error`, silently, and the file is written no
    more: the run stops on it at the end of the step, naming it, in one message (a traceback
    per log line, or an error of closing the file, would bury that message). Any other failure
    (a handler left open by a controller nobody closed, whose run directory is gone) is reported
    on stderr by logging's handleError, as before."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.error: OSError | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.error is not None:
            return
        try:
            super().emit(record)
        except OSError:
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:
        e = sys.exc_info()[1]
        if isinstance(e, OSError) and disk_error(e) is not None:
            self._give_up(e)
            return
        super().handleError(record)

    def _give_up(self, e: OSError) -> None:
        if self.error is None:
            self.error = named(e, self.baseFilename)
        stream, self.stream = self.stream, None
        if stream is not None:
            with contextlib.suppress(OSError):  # its buffer cannot be written either; the descriptor closes anyway
                stream.close()

    def close(self) -> None:
        try:
            super().close()
        except OSError as e:  # flushing the last lines on a full disk
            if disk_error(e) is None:
                raise
            self._give_up(e)


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

    @property
    def error(self) -> OSError | None:
        """The disk error that stopped train.log, if one did."""
        return self.handler.error

    def close(self) -> None:
        """Idempotent: the loop and close() both end the log. Never raises (RunLogHandler)."""
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
