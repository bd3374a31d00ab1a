"""Parallelism benchmarks: the chunked output head's peak memory against full-vocabulary logits.

`python benchmarks/parallel.py logprob`: one log-prob + entropy pass with its backward (the work
of a policy update's head) at Qwen's 151,936-token vocabulary, N tokens, hidden size H, float32,
in two ways: the full-logits path (`hidden @ weight.T` -> tidal.algorithms.token_logprobs and
entropy_from_logits, what the trainer did before) and tidal's chunked head
(tidal/trainer/parallel/logprob.py, `train.logprob_chunk_tokens` tokens at a time). Each
measurement runs in a fresh process; its peak is the process's peak resident memory
(ru_maxrss) less its resident memory once the inputs exist, so the inputs and the
weight's gradient are not counted and what remains is what the path itself holds at its
worst. Results: a table on stdout and benchmarks/results/parallel_logprob.json.

`python benchmarks/parallel.py mesh`: one training step (forward, backward, optimizer) of a
~100M-parameter Qwen3-style model (benchmarks/parallel_mesh.py) on 1 rank and on meshes of 2
and 4 gloo ranks, through the trainer's own `train.parallel` path.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 151_936


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def one(path: str, n: int, hidden: int, chunk: int) -> dict:
    import torch

    torch.manual_seed(0)
    h = torch.randn(n, hidden, requires_grad=True)
    w = (torch.randn(VOCAB, hidden) * 0.02).requires_grad_(True)
    w.grad = torch.zeros_like(w)  # the weight's gradient exists in both paths: not counted
    t = torch.randint(0, VOCAB, (n,))
    a = torch.randn(n)
    before = _rss_mib()
    start = time.perf_counter()
    if path == "full":
        from tidal.algorithms import entropy_from_logits, token_logprobs

        logits = h @ w.t()
        logp, ent = token_logprobs(logits, t), entropy_from_logits(logits)
    else:
        from tidal.trainer.parallel.logprob import head_logprobs

        logp, ent = head_logprobs(h, w, t, chunk=chunk)
    ((logp * a).sum() + 0.01 * ent.sum()).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"path": path, "tokens": n, "hidden": hidden, "chunk": chunk, "peak_mib": round(peak - before, 1),
            "seconds": round(seconds, 2), "logits_mib": round(n * VOCAB * 4 / 2**20, 1)}


def logprob(args) -> None:
    rows = []
    for n in args.tokens:
        for path in ("full", "chunked"):
            if path == "full" and n > args.max_full:
                continue
            cmd = [sys.executable, __file__, "one", path, str(n), str(args.hidden), str(args.chunk)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    full = {r["tokens"]: r["peak_mib"] for r in rows if r["path"] == "full"}
    print(f"\nvocab {VOCAB}, hidden {args.hidden}, chunk {args.chunk} tokens, float32, forward + backward")
    print("| tokens | logits [N, V] MiB | full-logits peak MiB | chunked peak MiB | chunked / full |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.tokens:
        ch = next(r for r in rows if r["tokens"] == n and r["path"] == "chunked")
        f = full.get(n)
        ratio = f"{ch['peak_mib'] / f:.3f}" if f else "-"
        print(f"| {n} | {ch['logits_mib']:.0f} | {f if f is not None else '(not run)'} | {ch['peak_mib']} | {ratio} |")
    out = Path(__file__).parent / "results" / "parallel_logprob.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"vocab": VOCAB, "rows": rows}, indent=1))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "mesh":
        from parallel_mesh import main as mesh_main  # benchmarks/ is on sys.path when run as a script

        mesh_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        print(json.dumps(one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    lp = sub.add_parser("logprob")
    lp.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 8192])
    lp.add_argument("--hidden", type=int, default=256)
    lp.add_argument("--chunk", type=int, default=512)
    lp.add_argument("--max-full", type=int, default=2048, help="largest N for the full-logits path (its memory)")
    args = p.parse_args()
    logprob(args)


if __name__ == "__main__":
    main()
