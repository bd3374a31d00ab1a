"""`tidal serve-rm`, `serve-policy`, `dashboard` and `replay`: servers over a model or over
run directories, and one recorded episode run again.

Every server binds to loopback unless told otherwise, and off loopback only with a token;
a bad bind or a missing token is refused before any model loads.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import threading

import torch

from tidal.cli.common import catch_stop_signals, no_extra_args, restore_signals, split_args
from tidal.config import load_config
from tidal.net import is_loopback
from tidal.rewards.rm import RewardModelError, RewardModelPool
from tidal.rewards.server import RewardServer, ServeError, check_bind
from tidal.runtime.replay import replay


def cmd_replay(ns: argparse.Namespace) -> int:
    """Run one recorded episode again and say whether it reproduces (tidal/runtime/replay.py)."""
    res = replay(ns.run_dir, ns.episode_id, ns.checkpoint)
    print(json.dumps(res.to_dict()) if ns.json else res.summary())
    return 0 if res.reproduced else 1


def cmd_serve_rm(ns: argparse.Namespace) -> int:
    no_extra_args(ns)
    token = ns.token
    if ns.token_env:
        token = os.environ.get(ns.token_env)
        if not token:
            print(f"tidal: error: --token-env {ns.token_env}: the environment variable is not set", file=sys.stderr)
            return 2
    try:
        check_bind(ns.host, token)  # before the model loads: a refused start costs nothing
        pool = RewardModelPool(ns.model, max_batch_size=ns.max_batch_size, max_wait_ms=ns.max_wait_ms,
                               device=ns.device, dtype=ns.dtype, threads=ns.threads)
        server = RewardServer(pool, ns.host, ns.port, token, transform=ns.transform, log_level=ns.log_level)
    except (ServeError, RewardModelError) as e:
        print(f"tidal: error: {e}", file=sys.stderr)
        return 2
    print(f"tidal: reward model {ns.model} on {server.url} (POST /score, POST /get_reward, GET /health"
          f"{'; token required' if token else ''})", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        pool.close()
    return 0


def cmd_serve_policy(ns: argparse.Namespace) -> int:
    """An OpenAI-compatible server over a model or checkpoint (tidal/runtime/gateway.py)."""
    from tidal.runtime.assemble import build_run

    config, overrides = split_args(ns.args)
    flags = [f"gateway.host={ns.host}"] if ns.host else []
    flags += [f"gateway.port={ns.port}"] if ns.port is not None else []
    cfg = load_config(config, [*overrides, *flags])
    if ns.token_env:
        token = os.environ.get(ns.token_env)
        if not token:
            print(f"tidal: error: --token-env {ns.token_env}: the environment variable is not set", file=sys.stderr)
            return 2
        cfg.gateway.token = token
    if not is_loopback(cfg.gateway.host) and not cfg.gateway.token:
        print(f"tidal: error: --host {cfg.gateway.host} is not loopback: give the clients' token with --token-env",
              file=sys.stderr)
        return 2
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    run = build_run(cfg, "serve", model=ns.model)
    server, engines, kind = run.gateway, run.engines, run.engine_kind
    print(f"tidal: serving {run.model_dir} as `{server.gateway.model_name}` on {server.url} ({len(engines)} {kind} "
          f"replica(s): {run.engine_why}; POST /v1/chat/completions, /v1/completions, GET /v1/models"
          f"{'; token required' if server.token else ''})", file=sys.stderr, flush=True)
    stop = threading.Event()
    previous = catch_stop_signals()  # SIGINT or SIGTERM: close the server and the engines, exit 0
    try:
        while server.thread.is_alive() and not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        restore_signals(previous)
        run.close()  # the server, then the engines
    return 0


def cmd_dashboard(ns: argparse.Namespace) -> int:
    """A web page over run directories (tidal/monitor/dashboard): curves, episodes, config diff."""
    from tidal.monitor.dashboard.data import DashboardError
    from tidal.monitor.dashboard.server import DashboardServer, MissingDashboardExtra
    token = None
    if ns.token_env:
        token = os.environ.get(ns.token_env)
        if not token:
            print(f"tidal: error: --token-env {ns.token_env}: the environment variable is not set", file=sys.stderr)
            return 2
    elif not is_loopback(ns.host):
        token = secrets.token_urlsafe(24)  # off loopback never without one; printed once, in the address below
    try:
        server = DashboardServer(ns.run_dirs + ns.args, ns.host, ns.port, token)
    except (DashboardError, MissingDashboardExtra) as e:
        print(f"tidal: error: {e}", file=sys.stderr)
        return 2
    address = server.url + (f"?token={token}" if token and not ns.token_env else "")
    print(f"tidal: dashboard of {len(server.runs)} run(s) on {address}" + (" (token required)" if token else ""),
          file=sys.stderr, flush=True)
    previous = catch_stop_signals()
    try:
        while server.thread.is_alive():
            server.thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        restore_signals(previous)
        server.close()
    return 0


def add_parsers(sub) -> None:
    s = sub.add_parser("serve-rm", help="serve a reward model over HTTP (tidal /score and OpenRLHF /get_reward)")
    s.add_argument("model", help="HF sequence-classification directory (e.g. from tidal train-rm)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind; not loopback only with a token")
    s.add_argument("--port", type=int, default=5000, help="port (0: a free one, printed)")
    s.add_argument("--token", default=None, help="bearer token clients must send (visible in `ps`: prefer --token-env)")
    s.add_argument("--token-env", default=None, help="name of an environment variable holding the token")
    s.add_argument("--max-batch-size", type=int, default=32)
    s.add_argument("--max-wait-ms", type=float, default=5.0)
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    s.add_argument("--transform", choices=["raw", "sigmoid", "standard"], default="raw",
                   help="raw logits, sigmoid, or standardized by the held-out score stats of tidal_rm.json")
    s.add_argument("--log-level", default="warning", help="uvicorn log level")
    s.set_defaults(fn=cmd_serve_rm, args=[])
    rp = sub.add_parser("replay", help="run one recorded episode again and say whether it reproduces")
    rp.add_argument("run_dir", help="the run's directory")
    rp.add_argument("episode_id", help="the episode's id, as in its step's Parquet file (e.g. s12-p3-e5)")
    rp.add_argument("--checkpoint", default=None, help="weights to replay with (default: the run's checkpoint of "
                    "the version that generated the episode)")
    rp.add_argument("--json", action="store_true", help="the report as JSON")
    rp.set_defaults(fn=cmd_replay, args=[])
    sp = sub.add_parser("serve-policy", help="serve a model or checkpoint through an OpenAI-compatible API")
    sp.add_argument("model", help="model directory, checkpoint directory, or 'default'")
    sp.add_argument("args", nargs="*", help="CONFIG.yaml and/or overrides: engine.kind=vllm, engine.replicas=2, "
                                            "gateway.model_name=..., gateway.max_tokens=..., run.threads=...")
    sp.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; elsewhere a token is required)")
    sp.add_argument("--port", type=int, default=None, help="port (default: a free one, printed)")
    sp.add_argument("--token-env", default=None, help="name of an environment variable holding the bearer token")
    sp.set_defaults(fn=cmd_serve_policy)
    d = sub.add_parser("dashboard", help="a web page of runs: curves, episodes, config diff (pip install "
                       "'tidal[dashboard]')")
    d.add_argument("run_dirs", nargs="+", help="run directories (several: curves overlaid, configs compared)")
    d.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; elsewhere a token "
                   "is required: --token-env, or a random one printed in the address)")
    d.add_argument("--port", type=int, default=8765, help="port (0: a free one, printed; default 8765)")
    d.add_argument("--token-env", default=None, help="name of an environment variable holding the token")
    d.set_defaults(fn=cmd_dashboard, args=[])
