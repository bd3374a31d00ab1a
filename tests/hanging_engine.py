"""An engine builder for tests (engine.kind=<this file>:build): the built-in torch engine, except
that the first replica to find the file named by TIDAL_TEST_HANG_MARKER (it removes it) hangs in
its weight update of version 2 and later: a sync that never finishes, on one replica, once."""

from __future__ import annotations

import os
import time


def build(cfg, model_dir, **kw):
    from tidal.engines.factory import ENGINES

    engine = ENGINES["torch"](cfg, model_dir, **kw)
    marker = os.environ.get("TIDAL_TEST_HANG_MARKER", "")
    real = engine.update_weights

    def update_weights(version, tensors):
        if version >= 2 and marker:
            try:
                os.remove(marker)  # exactly one replica wins
            except FileNotFoundError:
                pass
            else:
                time.sleep(3600)  # hung: the run must replace this replica
        return real(version, tensors)

    engine.update_weights = update_weights
    return engine
