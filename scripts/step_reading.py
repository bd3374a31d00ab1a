"""How much code a reader reads to follow one synchronous step of the default job.

    PYTHONPATH=. python scripts/step_reading.py [--list]

Runs the default job (`tidal train` with no arguments, run.dir in a temporary directory) for
one warm-up step, then traces one more `Controller.train_step` with a profile hook on every
thread, and counts the functions a reader must read to follow it, two ways:

- the path (the count the architecture issue bounds: at most 8 files and 900 lines): every
  tidal function that runs during the step in the loop's own package (`tidal/runtime/`),
  reached from `train_step` through runtime functions only, plus the two the path ends in,
  `Trainer.forward_backward` and `Trainer.optim_step`. A call into any other package (the
  components: trainer internals, engines, envs, rewards, algorithms, weightsync, monitor,
  models, config, types) is read at its call site, not opened;
- with every component entry: the same, plus the first function of each other package that
  the loop calls (`HackingMonitor.update`, `estimate_advantages`, `Engine.generate`, ...), but
  not what that function calls in turn.

Frames on the same call stack count as reached; asyncio tasks count through the event loop
that `tidal/envs/loop_scoped.py` runs for the loop, and the trainer's calls through the thread
that `tidal/trainer/threads.py` runs each on (neither runner is counted); a thread that runtime
code starts counts as reached.

Lines: the sum over those functions of `end_lineno - lineno + 1` (their definition, docstring
and body, as `ast` gives them); files: the files that define them. Module docstrings,
imports and functions not run are not counted. The numbers are in docs/architecture.md.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIDAL = str(ROOT / "tidal") + "/"
LOOP = TIDAL + "runtime/"
# Run the loop's own calls elsewhere: its coroutines (an event loop per call), and the trainer's
# calls on a thread that ends with each (tidal/trainer/threads.py): part of the loop's call
# stack, not components; what they run is counted as if called directly.
PASS = {TIDAL + "envs/loop_scoped.py", TIDAL + "trainer/threads.py"}
# Where the path ends: the trainer's two calls that the issue names (tidal/trainer/trainer.py).
ENDS = {"forward_backward", "optim_step"}


def spans(path: str) -> dict[tuple[str, int], int]:
    """(qualified-ish name, first line) → length in lines of every function in `path`."""
    out = {}
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out[(node.name, node.lineno)] = node.end_lineno - node.lineno + 1
            out[(node.name, start)] = node.end_lineno - node.lineno + 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print every function counted")
    ns = p.parse_args()
    from tidal.config import load_config
    from tidal.runtime.controller import Controller

    seen: set[tuple[str, int, str]] = set()

    def in_loop(path: str) -> bool:
        return path.startswith(LOOP) or path in PASS

    def counted(frame) -> bool:
        path = frame.f_code.co_filename
        if not path.startswith(TIDAL) or path in PASS:
            return False
        up = frame.f_back
        while up is not None:  # a component's internals are not read: stop at its entry function
            above = up.f_code.co_filename
            if above.startswith(TIDAL) and not in_loop(above):
                return False
            up = up.f_back
        if in_loop(path):
            return True
        # a component's function: counted as an entry when the loop called it on this stack
        up = frame.f_back
        while up is not None:
            if in_loop(up.f_code.co_filename):
                return True
            up = up.f_back
        return False

    def hook(frame, event, arg):
        if event == "call" and counted(frame):
            seen.add((frame.f_code.co_filename, frame.f_code.co_firstlineno, frame.f_code.co_name))

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [f"run.dir={tmp}/run", "run.progress=false", "run.eval_every=0", "run.save_every=0"])
        ctl = Controller(cfg)
        try:
            ctl.train_step()  # warm-up: lazy set-up paths run once
            threading.setprofile(hook)
            sys.setprofile(hook)
            try:
                ctl.train_step()
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
        finally:
            ctl.close()
    rows = []
    cache: dict[str, dict] = {}
    for path, line, name in sorted(seen):
        if name.startswith("<"):  # comprehensions, lambdas, module bodies: inside a counted function
            continue
        lengths = cache.setdefault(path, spans(path))
        n = lengths.get((name, line))
        if n is None:
            continue
        rows.append((path[len(str(ROOT)) + 1:], line, name, n))
    path_rows = [r for r in rows if r[0].startswith("tidal/runtime/")
                 or (r[0] == "tidal/trainer/trainer.py" and r[2] in ENDS)]
    for title, chosen in (("the path (the loop's functions and the trainer's two)", path_rows),
                          ("with every component entry the loop calls", rows)):
        files = sorted({r[0] for r in chosen})
        print(f"-- {title}")
        if ns.list:
            for path, line, name, n in chosen:
                print(f"{n:5d}  {path}:{line}  {name}")
        for f in files:
            print(f"{sum(r[3] for r in chosen if r[0] == f):5d}  {f}")
        print(f"{len(files)} files, {len(chosen)} functions, {sum(r[3] for r in chosen)} lines")


if __name__ == "__main__":
    main()
