"""tidal: reinforcement-learning post-training for language models."""

import os
import sys
from pathlib import Path

__version__ = "0.1.0"

# OpenMP's idle threads, for the torch that tidal imports next. A run does its torch work on more
# than one thread (the trainer on the learning thread, the torch engine on its scheduler thread),
# and each such thread has its own OpenMP team. With more OpenMP threads than cores, libgomp stops
# letting idle workers spin: they sleep after every parallel region, and waking them on every op
# of a decode step made the torch engine 2x slower on the default job once the trainer had run
# (docs/engines.md, "Shared prompts, the heap and OpenMP"). ACTIVE with a short spin count lets
# them spin briefly (3,000 pause iterations) whatever the count, then sleep. Why 3,000: a longer
# spin was faster on an idle machine and up to 10x slower beside one other busy process (the
# spinning workers take the cores from the ones working); BENCHMARKS.md, "Where a step's learning
# stages run", has the table. A value the user set wins, and nothing changes if torch was
# imported before tidal (libgomp reads these once, when it loads).
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")


def cache_root() -> Path:
    """Where tidal caches what it builds (merged adapters, the sandbox's native supervisor):
    $TIDAL_CACHE_DIR, default ~/.cache/tidal."""
    return Path(os.environ.get("TIDAL_CACHE_DIR") or Path.home() / ".cache" / "tidal")
