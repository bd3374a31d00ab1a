"""Delta sync over real weights: ten steps of the default job (`tidal train` with no arguments
but the step count), each version sent to one engine rank by delta sync and to another by full
sync (two sync groups, the engine ranks as threads of this process); the engine's bytes after
every delta equal the full path's, which equal the trainer's, bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from tidal.config import load_config
from tidal.engines.served import free_port
from tidal.runtime.controller import Controller
from tidal.weightsync import BroadcastGroup
from tidal.weightsync.delta import DELTA, FULL, DeltaConfig
from tidal.weightsync.plan import build_plan, full_slices, gather_layout
from tidal.weightsync.shard import ShardReceiver, ShardSender, share_plan

HOST = "127.0.0.1"


def _pair(name: str, named, delta: DeltaConfig | None):
    """A sync group of trainer rank 0 and one engine rank (a thread here); returns sender, receiver."""
    port, out = free_port(), {}

    def engine_side():
        g = BroadcastGroup.join(HOST, port, 1, 2, timeout_s=120, name=name)
        out["recv"] = ShardReceiver(g, share_plan(g, None))

    t = threading.Thread(target=engine_side)
    t.start()
    g = BroadcastGroup.join(HOST, port, 0, 2, timeout_s=120, name=name)
    layout = gather_layout(named)
    plan = share_plan(g, build_plan(layout, full_slices(layout, 1), 64 << 10, trainer_ranks=1))
    t.join(timeout=120)
    return ShardSender(g, plan, delta), out["recv"]


def _sync(sender: ShardSender, recv: ShardReceiver, version: int, named) -> tuple[dict, dict]:
    got = {}
    t = threading.Thread(target=lambda: got.update(recv.recv()))
    t.start()
    sent = sender.send(version, named)
    t.join(timeout=120)
    return sent, got


@pytest.mark.slow  # 82-93 s here under load: 10 steps of the default job
@pytest.mark.timeout(900)
def test_delta_equals_full_bit_for_bit_over_ten_steps_of_the_default_job(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "train.steps=10", "run.progress=false",
                             "run.eval_every=0", "run.save_every=0", "run.write_episodes=false"])
    ctl = Controller(cfg)
    try:
        named = ctl.trainer.named_weights()
        delta = _pair("delta", named, DeltaConfig(enabled=True, full_every=100))
        full = _pair("full", named, None)
        fractions = []
        for step in range(cfg.train.steps + 1):
            if step:
                ctl.train_step()
            named = {n: t.detach().clone() for n, t in ctl.trainer.named_weights().items()}
            version = ctl.trainer.version
            sent_d, got_d = _sync(*delta, version, named)
            sent_f, got_f = _sync(*full, version, named)
            assert got_d["version"] == got_f["version"] == version
            assert sent_d["modes"] == [FULL if step == 0 else DELTA] and sent_f["modes"] == [FULL]
            assert not got_d["mismatched"]
            for n, w in named.items():
                ref = w.contiguous().view(torch.uint8)
                assert torch.equal(full[1].held[n].view(torch.uint8), ref), (step, n)
                assert torch.equal(delta[1].held[n].view(torch.uint8), ref), (step, n)
            if step:
                fractions.append(got_d["bytes"] / got_d["raw_bytes"])
        print("delta bytes / full bytes per step (float32):", [f"{f:.3f}" for f in fractions])
        assert all(0 < f < 1 for f in fractions)  # every step changed something, and less than everything
    finally:
        for s, _ in (delta, full):
            s.group.close()
        ctl.close()
