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

`python benchmarks/parallel.py attention`: context parallelism's attention on one rank after the
Ulysses exchange (all S positions of its H/cp heads: 6 heads of 64 for the mesh model at cp 2),
forward and backward, float32, at sequence lengths S, in two ways: with the whole row's dense
[S, S] mask, as tidal's Ulysses did before (built as it built it: causal, padding, the diagonal;
`scaled_dot_product_attention` converts it to float32), and span by span with `is_causal`
(tidal/trainer/parallel/context.py's `causal_spans`: one span a row for the padded layout, one
per sequence for `train.packing`, here 8 sequences of S/8). Peak as for `logprob` (a fresh
process each, ru_maxrss less the resident memory once q, k, v exist). Results:
benchmarks/results/parallel_attention.json.

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


def attention_one(path: str, length: int, heads: int = 6, dim: int = 64) -> dict:
    import torch
    import torch.nn.functional as F

    from tidal.trainer.parallel.context import causal_spans

    torch.manual_seed(0)
    warm = [torch.randn(1, heads, 64, dim, requires_grad=True) for _ in range(3)]  # first calls' one-off setup
    F.scaled_dot_product_attention(*warm, attn_mask=torch.ones(64, 64, dtype=torch.bool)).sum().backward()
    causal_spans(*warm, [[(0, 32, None, None), (32, 64, None, None)]]).sum().backward()
    q, k, v = (torch.randn(1, heads, length, dim, requires_grad=True) for _ in range(3))
    before = _rss_mib()
    start = time.perf_counter()
    if path == "dense-mask":  # tidal's Ulysses before: the whole row's mask (padded layout, no padding)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        eye = torch.eye(length, dtype=torch.bool)
        valid = torch.ones(1, length, dtype=torch.bool)
        mask = (causal & valid[:, None, :])[:, None] | eye
        del causal, eye
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    elif path == "spans":
        out = causal_spans(q, k, v, None)
    else:  # packed: 8 sequences of length/8
        n = length // 8
        out = causal_spans(q, k, v, [[(i * n, (i + 1) * n, None, None) for i in range(8)]])
    out.square().sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"path": path, "length": length, "heads": heads, "dim": dim, "peak_mib": round(peak - before, 1),
            "seconds": round(seconds, 2), "qkv_mib": round(3 * length * heads * dim * 4 / 2**20, 1)}


def attention(args) -> None:
    rows = []
    for n in args.lengths:
        for path in ("dense-mask", "spans", "packed-spans"):
            if path == "dense-mask" and n > args.max_dense:
                continue
            cmd = [sys.executable, __file__, "attention-one", path, str(n)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    print("\n| S | q, k, v MiB | dense [S, S] mask: peak MiB | spans (padded layout): peak MiB | spans (8 packed "
          "sequences): peak MiB | spans / dense |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.lengths:
        got = {r["path"]: r for r in rows if r["length"] == n}
        d, sp, pk = (got.get(p, {}).get("peak_mib") for p in ("dense-mask", "spans", "packed-spans"))
        ratio = f"{sp / d:.3f}" if d else "-"
        print(f"| {n} | {got['spans']['qkv_mib']:.0f} | {d if d is not None else '(not run)'} | {sp} | {pk} | {ratio} |")
    out = Path(__file__).parent / "results" / "parallel_attention.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=1))


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
    if len(sys.argv) > 1 and sys.argv[1] == "attention-one":
        print(json.dumps(attention_one(sys.argv[2], int(sys.argv[3]))))
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
    at = sub.add_parser("attention")
    at.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    at.add_argument("--max-dense", type=int, default=16384, help="largest S for the dense mask (its memory)")
    args = p.parse_args()
    attention(args) if args.what == "attention" else logprob(args)


if __name__ == "__main__":
    main()
