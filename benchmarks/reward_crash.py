"""What a crashing reward costs the reward pool: wall time to score 64 calls of a reward that
segfaults on 1 completion in 8, and how many of the other 56 are lost with them, through the
local worker processes and (with --ray) through Ray reward actors.

    python benchmarks/reward_crash.py [--ray] [--rounds 3] [--workers 2]

Each round prints: seconds for the 64 calls, calls failed (8 are the reward's own crashes),
innocent calls lost (any failure of a call that does not crash).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import tempfile
import textwrap
import time

REWARD = textwrap.dedent('''
    import ctypes

    def crashy(completion):
        if int(completion) % 8 == 0:
            ctypes.string_at(0)  # SIGSEGV
        return 1.0
''')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ray", action="store_true", help="through Ray reward actors (as many as --workers)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    from tidal.config import RewardConfig, RewardSpec
    from tidal.rewards.contract import RewardInput
    from tidal.rewards.pool import build_scorer

    logging.getLogger("tidal.rewards").setLevel(logging.ERROR)  # the crashes' own warnings
    path = os.path.join(tempfile.mkdtemp(), "crashy.py")
    with open(path, "w") as f:
        f.write(REWARD)
    pm = [{"role": "user", "content": "What?"}]
    inputs = [RewardInput(f"e{i}", f"g{i // 8}", "t0", 1, "<p>", pm, str(i), [1], pm, [], {}) for i in range(64)]
    spec, cfg = [RewardSpec(fn=f"{path}:crashy")], RewardConfig(timeout_s=20, workers=args.workers)
    if args.ray:
        import ray

        from tidal.runtime.placement import keep_on_loopback
        from tidal.runtime.workers import RewardActors, RewardWorker

        keep_on_loopback()
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False)
        cls = ray.remote(RewardWorker).options(num_cpus=0, max_concurrency=64)
        scorer = build_scorer(spec, cfg, ray_handles=RewardActors(args.workers, lambda i, s, t: cls.remote(s, t)))
    else:
        scorer = build_scorer(spec, cfg)
    try:
        for r in range(args.rounds):
            t0 = time.monotonic()
            outs = asyncio.run(scorer.score(inputs))
            dt = time.monotonic() - t0
            failed = sum(o.status != "ok" for o in outs)
            innocent = sum(o.status != "ok" for i, o in enumerate(outs) if i % 8)
            print(f"{'ray' if args.ray else 'process'} x{args.workers} round {r}: {dt:.2f} s for 64 calls, "
                  f"{failed} failed, {innocent} innocent lost", flush=True)
    finally:
        scorer.shutdown()


if __name__ == "__main__":
    main()
