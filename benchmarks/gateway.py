"""Generated tokens/s through the gateway against direct engine calls, the same requests side
by side.

    python benchmarks/gateway.py [--rounds 3] [--sessions 64] [--turns 2] [--tokens 64 256]
                                 [--out benchmarks/results/gateway.json]

What it compares, on one torch engine behind a router (as in a run):

- gateway: `--sessions` concurrent agent sessions, each `--turns` chat calls in a row through
  the official `openai.AsyncOpenAI` client to the gateway on loopback (Starlette + uvicorn on its
  own thread, as inside a training run), under `/sessions/{id}/v1`: every call is rendered by
  the chat template, continued from the session's recorded tokens, generated, parsed and
  recorded; the next call appends the reply it got and a user message;
- direct: the same sessions calling `engine.generate` with the very prompt token ids, sampling
  parameters and seeds the gateway sent (captured in the gateway run), concurrently in the
  same pattern (each session's calls in a row).

With `--clients process` the agents' clients run in a process of their own (as they do on
Ray env workers), so their Python does not share the engine's interpreter lock; the default,
`thread`, runs them in the engine's process (local placement, the worst case on a small CPU).

Both generate the same tokens: the policy is a Qwen2 with random weights that never samples a
special token (`build_random_qwen2` of benchmarks/agents.py), so every call runs to
`--tokens`. Rounds alternate the order; the table gives medians. torch threads = 1 (the
engine's one device); the client, the server and the engine share this process, as agents and
the gateway share the driver of a local run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agents import build_random_qwen2

from tidal.config import GatewayConfig
from tidal.engines.router import Router
from tidal.engines.torch_engine import TorchEngine
from tidal.models import load_model, load_tokenizer
from tidal.runtime.gateway_http import start_gateway
from tidal.types import GenerationRequest, SamplingParams


async def agents(urls: list[str], api_key: str, turns: int, tokens: int) -> tuple[float, int, list]:
    """The agents: each session's calls in a row, all sessions at once."""
    import openai

    sent: list = []  # (session, turn, prompt ids, completion tokens) of every call, for the direct replay
    clients = [openai.AsyncOpenAI(base_url=u, api_key=api_key, max_retries=0) for u in urls]

    async def one(s: int) -> int:
        messages = [{"role": "user", "content": f"Session {s}: tell me a story."}]
        n = 0
        for t in range(turns):
            r = await clients[s].chat.completions.create(model="bench", messages=messages, max_tokens=tokens,
                                                         extra_body={"return_token_ids": True})
            body = r.model_dump()
            sent.append((s, t, body["prompt_token_ids"], len(body["choices"][0]["token_ids"])))
            n += len(body["choices"][0]["token_ids"])
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(s) for s in range(len(urls))))
    wall = time.perf_counter() - t0
    for c in clients:
        await c.close()
    return wall, sum(counts), sent


def gateway_round(server, sessions: int, turns: int, tokens: int, tag: str, clients: str = "thread"):
    gw = server.gateway
    params = SamplingParams(max_new_tokens=tokens, stop_token_ids=())
    for s in range(sessions):
        gw.open_session(f"{tag}-{s}", params, seed=s)
    urls = [server.session_url(f"{tag}-{s}") for s in range(sessions)]
    try:
        if clients == "thread":
            return asyncio.run(agents(urls, server.api_key, turns, tokens))
        import subprocess

        out = subprocess.run([sys.executable, __file__, "--agents", json.dumps([urls, server.api_key, turns, tokens])],
                             capture_output=True, text=True, check=True, timeout=1200)
        wall, n, sent = json.loads(out.stdout.strip().splitlines()[-1])
        return wall, n, [tuple(x) for x in sent]
    finally:
        for s in range(sessions):
            gw.close_session(f"{tag}-{s}")


async def direct_round(router, sent: list, sessions: int, turns: int, tokens: int, tag: str) -> tuple[float, int]:
    from tidal.runtime.rollout import request_seed

    by = {(s, t): ids for s, t, ids, _ in sent}

    async def one(s: int) -> int:
        n = 0
        for t in range(turns):
            p = SamplingParams(max_new_tokens=tokens, stop_token_ids=(), seed=request_seed(s, t, 0))
            (res,) = await router.generate([GenerationRequest(f"{tag}-{s}-{t}", by[(s, t)], p, session_id=f"{tag}-{s}")])
            n += len(res.token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(s) for s in range(sessions)))
    return time.perf_counter() - t0, sum(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256], help="tokens per call; one table row each")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--clients", choices=["thread", "process"], default="thread",
                    help="where the agents' clients run: in this process, or in one of their own")
    ap.add_argument("--out", default="benchmarks/results/gateway.json")
    ap.add_argument("--agents", help=argparse.SUPPRESS)  # internal: run the clients only (--clients process)
    args = ap.parse_args()
    if args.agents:
        urls, key, turns, tokens = json.loads(args.agents)
        print(json.dumps(asyncio.run(agents(urls, key, turns, tokens))))
        return
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="tidal-gw-bench-"))
    model_dir = build_random_qwen2(tmp / "model", hidden=args.hidden, layers=args.layers)
    tokenizer = load_tokenizer(model_dir)
    engine = TorchEngine(load_model(model_dir), tokenizer.pad_token_id, max_batch_size=args.sessions,
                         tokenizer=tokenizer)
    router = Router([engine])
    server = start_gateway(router, tokenizer, model_dir, GatewayConfig(model_name="bench"))
    # one warm-up of each (first-call costs: the template, the client's connection pool)
    _, _, sent = gateway_round(server, 4, 1, 8, "warm", args.clients)
    asyncio.run(direct_round(router, sent, 4, 1, 8, "warm"))
    table = {}
    for tokens in args.tokens:
        rows = []
        for r in range(args.rounds):
            order = ["gateway", "direct"] if r % 2 == 0 else ["direct", "gateway"]
            tag = f"t{tokens}r{r}"
            if order[0] == "direct":  # the direct run replays the gateway's requests: capture them first, untimed
                _, _, sent = gateway_round(server, args.sessions, args.turns, tokens, f"cap-{tag}", args.clients)
            out = {}
            for what in order:
                if what == "gateway":
                    wall, n, sent = gateway_round(server, args.sessions, args.turns, tokens, f"g-{tag}",
                                                  args.clients)
                else:
                    wall, n = asyncio.run(direct_round(router, sent, args.sessions, args.turns, tokens, f"d-{tag}"))
                out[what] = {"wall_s": round(wall, 3), "tokens": n, "tokens_per_s": round(n / wall, 1)}
            out["ratio"] = round(out["gateway"]["tokens_per_s"] / out["direct"]["tokens_per_s"], 3)
            print(f"{tokens} tokens/call, round {r + 1}: gateway {out['gateway']['tokens_per_s']:.0f} tok/s, direct "
                  f"{out['direct']['tokens_per_s']:.0f} tok/s, ratio {out['ratio']:.3f}", flush=True)
            rows.append(out)
        table[str(tokens)] = {
            "rounds": rows,
            "median": {"gateway_tokens_per_s": statistics.median(r["gateway"]["tokens_per_s"] for r in rows),
                       "direct_tokens_per_s": statistics.median(r["direct"]["tokens_per_s"] for r in rows),
                       "ratio": statistics.median(r["ratio"] for r in rows)}}
    server.close()
    engine.close()
    result = {
        "args": vars(args), "by_tokens_per_call": table,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "load_avg": os.getloadavg()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v["median"] for k, v in table.items()}))


if __name__ == "__main__":
    main()
