"""`tidal train | eval | build-default-model`.

    tidal train [CONFIG.yaml] [section.key=value ...] [--resume]
    tidal eval MODEL_OR_CHECKPOINT [CONFIG.yaml] [section.key=value ...] [--json]
    tidal build-default-model [--out DIR] [--seed N]

Errors a person can act on are printed as one message (no traceback) with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tidal.config import ConfigError, TidalConfig, load_config
from tidal.envs.dataset import DatasetError
from tidal.models import ModelLoadError

USER_ERRORS = (ConfigError, ModelLoadError, DatasetError, FileExistsError, FileNotFoundError)


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    config = None
    overrides = []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif config is None and a.endswith((".yaml", ".yml")):
            config = a
        else:
            raise ConfigError(f"unexpected argument `{a}`: expected a YAML config file or `section.key=value`")
    return config, overrides


def cmd_train(ns: argparse.Namespace) -> int:
    from tidal.runtime.controller import Controller

    config, overrides = _split_args(ns.args)
    cfg = load_config(config, overrides)
    ctl = Controller(cfg, resume=ns.resume)
    print(f"tidal: run directory {ctl.paths.root}  (model {ctl.model_dir}, {cfg.rollout.prompts_per_step}×"
          f"{cfg.rollout.samples_per_prompt} episodes per step, {cfg.train.steps} steps; engine {ctl.engine_choice})",
          file=sys.stderr)
    t0 = time.time()
    try:
        last = ctl.train()
    finally:
        ctl.close()
    print(json.dumps({"run_dir": str(ctl.paths.root), "step": ctl.step, "wall_s": round(time.time() - t0, 1),
                      "reward": last.get("reward"), "accuracy": last.get("accuracy")}))
    return 0


def _config_for_model(model: str, config: str | None, overrides: list[str]) -> TidalConfig:
    """A checkpoint evaluates on the task of its own run unless a config is given."""
    if config is None:
        for parent in [Path(model), *Path(model).parents][:4]:
            if (parent / "config.yaml").is_file() and (parent / "metrics.jsonl").exists():
                config = str(parent / "config.yaml")
                break
    return load_config(config, overrides)


def cmd_eval(ns: argparse.Namespace) -> int:
    from tidal.engines.torch_engine import TorchEngine
    from tidal.models import load_model, load_tokenizer, resolve_model_dir, stop_token_ids
    from tidal.runtime.evaluate import evaluate_engine
    from tidal.runtime.tasks import build_task
    from tidal.types import SamplingParams

    config, overrides = _split_args(ns.args)
    cfg = _config_for_model(ns.model, config, overrides)
    model_dir = resolve_model_dir(ns.model)
    tokenizer = load_tokenizer(model_dir)
    task = build_task(cfg.task)
    engine = TorchEngine(load_model(model_dir, cfg.model.dtype, cfg.model.resolved_device()), tokenizer.pad_token_id,
                         cfg.engine.max_batch_size)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=stop_token_ids(tokenizer))
    t0 = time.time()
    res = evaluate_engine(engine, tokenizer, task.eval_rows[: cfg.eval.n], task.make_env, params,
                          k=cfg.eval.k, temperature=cfg.eval.temperature)
    res = {"model": str(model_dir), **res, "wall_s": round(time.time() - t0, 1)}
    if ns.json:
        print(json.dumps(res))
    else:
        print(f"{model_dir}: held-out accuracy (greedy) {res['accuracy']:.3f}  pass@{res['k']} {res['pass_at_k']:.3f}  "
              f"pass@1 (T={res['temperature']}) {res['pass_at_1']:.3f}  on {res['n']} problems")
    return 0


def cmd_build(ns: argparse.Namespace) -> int:
    from tidal.models.tiny import build_default_model

    summary = build_default_model(ns.out, seed=ns.seed)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tidal", description="RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a policy with RL")
    t.add_argument("args", nargs="*", help="CONFIG.yaml and/or section.key=value overrides")
    t.add_argument("--resume", action="store_true", help="continue the run in run.dir from its latest checkpoint")
    t.set_defaults(fn=cmd_train)
    e = sub.add_parser("eval", help="held-out accuracy and pass@k of a model or checkpoint")
    e.add_argument("model", help="model directory, checkpoint directory, or 'default'")
    e.add_argument("args", nargs="*", help="CONFIG.yaml and/or section.key=value overrides (eval.n, eval.k, ...)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(fn=cmd_eval)
    b = sub.add_parser("build-default-model", help="rebuild the embedded tiny model deterministically")
    from tidal.models import DEFAULT_MODEL_DIR

    b.add_argument("--out", default=str(DEFAULT_MODEL_DIR))
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(fn=cmd_build)
    # Options may come before, between or after the overrides (`train a=1 --resume b=2`).
    ns, rest = p.parse_known_args(argv)
    if any(r.startswith("-") for r in rest):
        p.error(f"unrecognized arguments: {' '.join(r for r in rest if r.startswith('-'))}")
    ns.args = [*ns.args, *rest]
    try:
        return ns.fn(ns)
    except USER_ERRORS as err:
        print(f"tidal: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tidal: interrupted; the last complete checkpoint is intact (resume with --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
