"""tidal: reinforcement-learning post-training for language models."""

import os
from pathlib import Path

__version__ = "0.1.0"


def cache_root() -> Path:
    """Where tidal caches what it builds (merged adapters, the sandbox's native supervisor):
    $TIDAL_CACHE_DIR, default ~/.cache/tidal."""
    return Path(os.environ.get("TIDAL_CACHE_DIR") or Path.home() / ".cache" / "tidal")
