"""Topology: which trainer ranks must share a node, how Ray is asked to keep them together, and
whether a launcher's ranks are (pure functions; placement.py and launcher.py use them).

The rule: the ranks of one data-parallel position (train.parallel's tp × cp × ep consecutive
ranks: the mesh puts tensor parallelism innermost, tidal/trainer/parallel/mesh.py) share a
node. Their collectives run in every layer (tensor-parallel all-reduces, expert all-to-alls,
context-parallel exchanges), so they belong on the node's fast links (NVLink); only the
data-parallel collectives, once per step, cross nodes. With plain FSDP (group size 1) any
rank may go anywhere and nothing is asked.

Ray: one placement group per such group of ranks, strategy STRICT_PACK (all its bundles on one
node, or the group is not placed and the start fails naming the ranks and what they need);
the other roles keep `placement.strategy` in a group of their own. A launcher places ranks
itself (torchrun, srun and mpirun number a node's processes consecutively by default): rank 0
learns each rank's host and says which group spans nodes, and how to fix it.
"""

from __future__ import annotations


def group_size(tp: int, cp: int = 1, ep: int = 1) -> int:
    """Consecutive ranks that must share a node: one data-parallel position's."""
    return tp * cp * ep


def node_groups(world_size: int, size: int) -> list[list[int]]:
    """The groups of ranks that must share a node; [] when any rank may go anywhere."""
    if size <= 1:
        return []
    if world_size % size:
        raise ValueError(f"{world_size} trainer ranks do not split into groups of {size} (tp × cp × ep)")
    return [list(range(start, start + size)) for start in range(0, world_size, size)]


def bundle_layout(world_size: int, size: int, trainer_bundle: dict[str, float],
                  other_bundles: list[dict[str, float]]) -> tuple[list[list[dict[str, float]]], list[dict[str, float]],
                                                                   list[tuple[int, int]]]:
    """Ray's placement groups for `world_size` trainer ranks of `trainer_bundle` each, in groups
    of `size` that share a node, and the other roles' bundles. Returns (one STRICT_PACK list of
    bundles per group, the bundles of the remaining group, and for each rank (its group, its
    bundle index)), where group len(strict) is the remaining one: without node groups the
    trainer ranks go there first, as before."""
    groups = node_groups(world_size, size)
    if not groups:
        rest = [dict(trainer_bundle) for _ in range(world_size)] + [dict(b) for b in other_bundles]
        return [], rest, [(0, r) for r in range(world_size)]
    strict = [[dict(trainer_bundle) for _ in g] for g in groups]
    slots = [(r // size, r % size) for r in range(world_size)]
    return strict, [dict(b) for b in other_bundles], slots


def total(bundles: list[dict[str, float]]) -> dict[str, float]:
    """What a group of bundles needs in all (to say what a node must offer)."""
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def split_groups(groups: list[list[int]], hosts: dict[int, str]) -> list[str]:
    """For each group whose ranks are on more than one host (`hosts`: rank → host name), a
    sentence that names the ranks and the hosts."""
    out = []
    for g in groups:
        where = sorted({hosts[r] for r in g if r in hosts})
        if len(where) > 1:
            out.append(f"trainer ranks {g[0]}-{g[-1]} form one tensor/expert/context-parallel group but run on "
                       f"{len(where)} nodes ({', '.join(where)}): their per-layer collectives cross nodes")
    return out
