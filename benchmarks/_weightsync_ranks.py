"""What the 2 trainer ranks x 2 engine ranks weight-sync benchmarks share (`_weightsync_scale.py`,
`_weightsync_tp.py`): the four gloo processes on 127.0.0.1, the trainer ranks' halves of the
100M model (FSDP2's dp_shard 2 rows) and their layout, the all-gather today's paths start with,
the timed repetitions, and the spawn that collects what each rank saved.

Each repetition of each method runs between two barriers of the four ranks and is timed on the
calling rank's clock; repetition 0 warms up and is not kept.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
WORLD = 4  # trainer ranks 0, 1; engine ranks 2, 3


def start(i: int, port: int):
    """Rank i joins the default gloo group of the four (barriers, the trainers' all-gather);
    returns the trainer ranks' group."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=i, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    return dist.new_group([0, 1])


def halves(model, rank: int) -> dict[str, torch.Tensor]:
    """Trainer rank `rank`'s half of every tensor: its rows, as FSDP2 at dp_shard 2."""
    return {n: p.detach().chunk(2, dim=0)[rank].clone() for n, p in model.named_parameters()}


def layout(model):
    """The trainer's layout of `halves` (tidal/weightsync/plan.py's ParamLayout per tensor)."""
    from tidal.weightsync.plan import ParamLayout, full_box

    out = {}
    for n, p in model.named_parameters():
        owners = []
        at = 0
        for r, c in enumerate(p.detach().chunk(2, dim=0)):
            box = list(full_box(p.shape))
            box[0] = (at, at + c.shape[0])
            owners.append((r, tuple(box)))
            at += c.shape[0]
        out[n] = ParamLayout(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), tuple(owners))
    return out


def gather_full(mine: dict[str, torch.Tensor], trainers) -> dict[str, torch.Tensor]:
    """Every tensor all-gathered on both trainer ranks, as `named_weights()` does before today's
    broadcast and slices paths send."""
    full = {}
    for name, t in mine.items():
        parts = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(parts, t, group=trainers)
        full[name] = torch.cat(parts)
    return full


def timed(reps: int, methods: Sequence[str], run: Callable[[str, int], float],
          before: Callable[[int], None] | None = None) -> tuple[dict, dict]:
    """`run(method, version)` -> bytes this rank received, for every method, reps + 1 times;
    `before(rep)` runs untimed first. Returns this rank's times and bytes per method."""
    times: dict = {m: [] for m in methods}
    got: dict = {m: [] for m in methods}
    for rep in range(reps + 1):
        if before is not None:
            before(rep)
        for method in methods:
            dist.barrier()
            t0 = time.perf_counter()
            n = run(method, rep + 1)
            dist.barrier()
            if rep:
                times[method].append(time.perf_counter() - t0)
                got[method].append(n)
    return times, got


def spawn(worker, reps: int, bucket: int, ranks: Sequence[int], prefix: str) -> list[dict]:
    """Run `worker(i, ports, reps, bucket, out_path)` on the four ranks (three free ports); the
    results ranks `ranks` saved to `out_path.i`."""
    import tempfile

    import torch.multiprocessing as mp

    from tidal.engines.served import free_port

    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        path = os.path.join(d, "out")
        mp.spawn(worker, args=((free_port(), free_port(), free_port()), reps, bucket, path), nprocs=WORLD, join=True)
        return [torch.load(f"{path}.{i}") for i in ranks]


def timing(times: dict[str, list[float]], method: str, bases: Sequence[str]) -> dict:
    """A method's median time per sync and its median ratio to each base method, repetition by
    repetition (the ratios side by side in one run, as BENCHMARKS.md reports them)."""
    out = {"median_s": statistics.median(times[method]), "all_s": times[method]}
    for b in bases:
        out[f"ratio_to_{b}"] = statistics.median(t / r for t, r in zip(times[method], times[b]))
    return out
