"""Does a tiny tool model call tools it never saw, and if not, which part is missing?
(tidal/recipes/tool_probe.py): the share of sampled first turns that call `convert`
(examples/envs/unit_convert.py) and `list_trains` (examples/envs/train_lookup.py) well-formed,
and the teacher-forced loss of the right call on trained and held-out generated worlds, split
into name, argument names, values and format. The figures in docs/agents.md, "Tools the model
never saw".

    python benchmarks/tool_model_probe.py MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--n", type=int, default=40, help="generated worlds per split for the copy losses")
    ns = ap.parse_args()
    torch.set_num_threads(1)  # tiny matrices: one thread is the fastest on a shared machine
    from tidal.recipes.tool_probe import call_copy_losses, first_turn_calls

    sys.path.insert(0, str(ROOT / "examples" / "envs"))
    import train_lookup
    import unit_convert

    print("| model | `convert` first turns | `list_trains` first turns | copy loss, trained worlds "
          "(name / arg names / values / format) | held-out worlds |")
    print("| --- | --- | --- | --- | --- |")
    for m in ns.models:
        conv = first_turn_calls(m, unit_convert.UnitConvertEnv, "convert")
        trains = first_turn_calls(m, train_lookup.TrainLookupEnv, "list_trains")
        tr, te = call_copy_losses(m, "train", ns.n), call_copy_losses(m, "test", ns.n)
        print(json.dumps({"model": m, "convert": conv, "list_trains": trains, "train": tr, "test": te}),
              file=sys.stderr)
        fmt = " / ".join
        print(f"| {m} | {conv:.2f} | {trains:.2f} | {fmt(str(tr[k]) for k in ('name', 'arg_name', 'value', 'format'))}"
              f" | {fmt(str(te[k]) for k in ('name', 'arg_name', 'value', 'format'))} |")


if __name__ == "__main__":
    main()
