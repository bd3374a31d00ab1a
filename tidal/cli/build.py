"""`tidal build-*` and `tidal train-rm`: rebuild the embedded tiny models (tidal/recipes/).

Each build runs on a stated number of torch threads, because a build is deterministic per
thread count (the shipped models record theirs); its summary is printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tidal.cli.common import no_extra_args
from tidal.models import (
    BROWSER_MODEL_DIR,
    DEFAULT_MODEL_DIR,
    DEFAULT_VLM_DIR,
    GENERAL_TOOL_MODEL_DIR,
    MOE_MODEL_DIR,
    TOOL_MODEL_DIR,
)


def cmd_build(ns: argparse.Namespace) -> int:
    from tidal.recipes.tiny import build_default_model

    summary = build_default_model(ns.out, seed=ns.seed)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    return 0


def _build(ns: argparse.Namespace, build, drop: tuple[str, ...] = ("history",), **kwargs) -> int:
    """A `tidal build-*` command: `build(ns.out, seed=ns.seed, **kwargs)` on `ns.threads` torch
    threads (the shipped builds record theirs), its summary printed as JSON without `drop`."""
    no_extra_args(ns)
    torch.set_num_threads(ns.threads)
    summary = build(ns.out, seed=ns.seed, **kwargs)
    print(json.dumps({k: v for k, v in summary.items() if k not in drop}))
    return 0


def cmd_build_tool(ns: argparse.Namespace) -> int:
    from tidal.recipes.tool_model import build_tool_model

    return _build(ns, build_tool_model)


def cmd_build_general_tool(ns: argparse.Namespace) -> int:
    from tidal.recipes.general_tool_model import build_general_tool_model

    return _build(ns, build_general_tool_model, ("history", "losses", "tune"), steps=ns.steps,
                  tune_steps=ns.tune_steps)


def cmd_build_browser(ns: argparse.Namespace) -> int:
    from tidal.recipes.browser_model import build_browser_model

    return _build(ns, build_browser_model)


def cmd_build_vlm(ns: argparse.Namespace) -> int:
    from tidal.recipes.vlm_build import build_default_vlm

    return _build(ns, build_default_vlm, ())


def cmd_build_moe(ns: argparse.Namespace) -> int:
    from tidal.recipes.moe_model import build_default_moe

    return _build(ns, build_default_moe)


def cmd_train_rm(ns: argparse.Namespace) -> int:
    from tidal.recipes.train_rm import train_reward_model

    no_extra_args(ns)
    try:
        summary = train_reward_model(ns.out, init=ns.init, pairs=ns.pairs, steps=ns.steps, batch_size=ns.batch_size,
                                     lr=ns.lr, seed=ns.seed, heldout_pairs=ns.heldout_pairs, threads=ns.threads,
                                     log=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"tidal: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": ns.out, "heldout_pairwise_accuracy": summary["heldout"]["accuracy"],
                      "heldout_pairwise_accuracy_eos": summary["heldout"]["accuracy_eos"],
                      "by_kind": summary["heldout"]["by_kind"], "heldout_at_init": summary["heldout_at_init"],
                      "wall_s": summary["wall_s"]}))
    return 0


def _builder(sub, name: str, help: str, out: str | None, fn, threads: int, shipped: bool = False):
    """A `build-*` command's parser: --out (required when `out` is None), --seed, --threads."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--out", **({"required": True} if out is None else {"default": out}))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=threads,
                   help="torch threads (the result is deterministic per count"
                        + (f"; the shipped model: {threads})" if shipped else ")"))
    p.set_defaults(fn=fn, args=[])
    return p


def add_parsers(sub) -> None:
    b = sub.add_parser("build-default-model", help="rebuild the embedded tiny model deterministically")
    b.add_argument("--out", default=str(DEFAULT_MODEL_DIR))
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(fn=cmd_build)
    _builder(sub, "build-tool-model", "rebuild the tiny tool-calling model (tool_arith) deterministically",
             str(TOOL_MODEL_DIR), cmd_build_tool, threads=1)
    bg = _builder(sub, "build-general-tool-model",
                  "rebuild the embedded tool model that calls tools from their schemas (default-tool: docs/agents.md)",
                  str(GENERAL_TOOL_MODEL_DIR), cmd_build_general_tool, threads=1, shipped=True)
    bg.add_argument("--steps", type=int, default=3000, help="SFT steps of the first phase (docs/agents.md)")
    bg.add_argument("--tune-steps", type=int, default=4500,
                    help="SFT steps of the second phase, on wide worlds with a fresh schedule (0: none)")
    _builder(sub, "build-browser-model", "rebuild the tiny browser model (click_button) deterministically",
             str(BROWSER_MODEL_DIR), cmd_build_browser, threads=2, shipped=True)
    _builder(sub, "build-default-vlm", "rebuild the embedded tiny vision-language model (image tasks) deterministically",
             str(DEFAULT_VLM_DIR), cmd_build_vlm, threads=2)
    _builder(sub, "build-moe", "rebuild the embedded tiny mixture of experts (default-moe) deterministically",
             str(MOE_MODEL_DIR), cmd_build_moe, threads=1, shipped=True)
    r = sub.add_parser("train-rm", help="train a tiny reward model (Bradley-Terry) on synthetic arithmetic preferences")
    r.add_argument("--out", default="runs/reward-model", help="output HF directory (default: runs/reward-model)")
    r.add_argument("--pairs", type=int, default=4000, help="training pairs, from the task's train split")
    r.add_argument("--steps", type=int, default=400)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--batch-size", type=int, default=32, help="pairs per step")
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--heldout-pairs", type=int, default=500, help="pairs from the held-out split, to measure only")
    r.add_argument("--init", default=None, help="initial weights and tokenizer (default: the embedded tiny model)")
    r.add_argument("--threads", type=int, default=1, help="torch threads (the result is deterministic per count)")
    r.set_defaults(fn=cmd_train_rm, args=[])
