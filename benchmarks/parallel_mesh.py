"""Multi-rank benchmark of the trainer's device mesh: memory per rank and tokens/s of one step.

`python benchmarks/parallel.py mesh`: a Qwen3-style model of ~100M parameters (transformers'
Qwen3Config, random initialisation, seed 0, saved once to a temporary directory), one training
step (forward + backward + AdamW step) through tidal's own Trainer (tidal/trainer/trainer.py:
`train.parallel` -> tidal/trainer/parallel's `parallelize`, the same code `tidal train` runs), on
1 rank and on each mesh asked for, every rank a gloo process on loopback (torch.multiprocessing
spawn, one fresh set of processes per configuration, each under a subprocess timeout).

The batch is one sequence of L tokens per data-parallel group (a prompt of L/8 tokens, the rest
a response with advantages), `train.micro_batch_tokens = L` (one micro-batch): a tp or cp group
shares its sequence, a dp_shard rank has its own, so tokens/s is the whole mesh's. Activation
checkpointing is on (`train.activation_checkpointing`), the output head is chunked
(`train.logprob_chunk_tokens`, 512), float32, one torch thread per rank.

Memory, per rank, from the process's own accounting (each rank its own process):
- `state_mib`: the bytes of the tensors this rank holds for the model: its local shards of the
  parameters, their gradients and AdamW's two moments (DTensor `to_local()`), after the step;
- `resident_mib`: the process's resident memory once the trainer is built and every parameter
  shard read once (libraries, the parameter shards: weights transformers maps from the
  checkpoint file only count once touched; the full model each rank loaded was released:
  glibc's mmap threshold is pinned at 128 KiB so freed tensors go back to the system);
- `peak_fb_mib` / `peak_step_mib`: the resident high-water mark (VmHWM, reset through
  /proc/self/clear_refs once the trainer is built) at the end of forward+backward and of the
  whole step;
- `activations_mib` = `peak_fb_mib - resident_mib - gradient bytes`: what forward and backward
  held beyond the parameters and their gradients (activations, the recomputed block, attention,
  the head's chunks, communication buffers).
Results: a table on stdout and benchmarks/results/parallel_mesh.json (rows appended as each
configuration finishes, so an interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MESHES = {"1": {}, "dp_shard2": {"dp_shard": 2}, "tp2": {"tp": 2}, "cp2": {"cp": 2},
          "dp_shard2_tp2": {"dp_shard": 2, "tp": 2}, "tp2_cp2": {"tp": 2, "cp": 2}}
# ~100M parameters: 25.2M embedding + 25.2M untied head + 8 blocks of 6.3M. 12 heads and 4 KV
# heads divide by tp 2 and then by cp 2; the vocabulary and MLP width by 2.
MODEL = {"vocab_size": 32768, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8,
         "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 65536,
         "tie_word_embeddings": False}
RESULTS = Path(__file__).parent / "results" / "parallel_mesh.json"
MIB = 2**20


def build_model(path: Path) -> int:
    """Save the seeded random model under `path`; return its parameter count."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**MODEL))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def expected_mib(n_params: int, parallel: dict, length: int) -> dict:
    """What the shape predicts per rank: parameters + gradients + two AdamW moments (16 bytes a
    parameter, float32) over dp_shard x cp x tp (FSDP shards over dp_shard x cp); the activations checkpointing keeps (each block's input,
    [L/cp, hidden] float32) plus one block recomputed in backward (~10 hidden-wide and 4 MLP-wide
    [L/cp, .] tensors), over cp. An estimate to decide what fits, not a measurement."""
    shard = parallel.get("dp_shard", 1) * parallel.get("cp", 1) * parallel.get("tp", 1)  # FSDP shards over dp_shard x cp
    tokens = length / parallel.get("cp", 1)
    h, i, layers = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["num_hidden_layers"]
    act = tokens * 4 * (layers * h + (10 * h + 4 * i) / parallel.get("tp", 1))
    return {"state_mib": round(16 * n_params / shard / MIB), "activations_mib": round(act / MIB)}


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _local_mib(tensors) -> float:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None) / MIB


def _batch(length: int, n: int, vocab: int):
    from tidal.trainer.trainer import TrainBatch

    rng = random.Random(0)
    prompt = length // 8
    tokens = [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]
    masks = [[False] * prompt + [True] * (length - prompt) for _ in range(n)]
    adv = [[rng.uniform(-1, 1) if m else 0.0 for m in mk[1:]] for mk in masks]
    behav = [[-5.0 if m else 0.0 for m in mk] for mk in masks]
    return TrainBatch(tokens, masks, adv, behav)


def worker(rank: int, world: int, port: int, model_dir: str, parallel: dict, length: int, out: str) -> None:
    import torch

    from tidal.config import AlgorithmConfig, ParallelConfig, TrainConfig
    from tidal.trainer import distributed as dp
    from tidal.trainer.trainer import Trainer

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if world > 1:
        dp.init_distributed(rank, world, "127.0.0.1", port, timeout_s=3600)
    try:
        train = TrainConfig(micro_batch_tokens=length, warmup_steps=0, activation_checkpointing=True,
                            parallel=ParallelConfig(**parallel))
        tr = Trainer(model_dir, train, AlgorithmConfig(), pad_token_id=0)
        for p in tr.model.parameters():  # pages of weights mapped from the checkpoint file become resident
            float(_local(p).sum())
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        resident, resident_file = _rss_mib("VmRSS"), _rss_mib("RssFile")  # RssFile: pages mapped from files
        batch = _batch(length, tr.dims.dp_size, MODEL["vocab_size"])
        shard = dp.balanced_shards([len(t) for t in batch.tokens], tr.dims.dp_size)[tr.dims.dp_index(rank)]
        dp.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here
        start = time.perf_counter()
        tr.forward_backward(batch.select(shard), totals=batch.totals())
        peak_fb = _rss_mib("VmHWM")
        grads = _local_mib(p.grad for p in tr.model.parameters())
        tr.optim_step()
        dp.barrier()
        seconds = time.perf_counter() - start
        params = _local_mib(tr.model.parameters())
        moments = _local_mib(v for st in tr.optimizer.state.values() for v in st.values()
                             if torch.is_tensor(v) and v.dim() > 0)
        row = {"rank": rank, "seconds": seconds, "tokens": length * tr.dims.dp_size, "resident_mib": resident,
               "resident_file_mib": resident_file,
               "peak_fb_mib": peak_fb, "peak_step_mib": _rss_mib("VmHWM"), "params_mib": params, "grads_mib": grads,
               "moments_mib": moments, "state_mib": params + grads + moments,
               "activations_mib": peak_fb - resident - grads}
        Path(out, f"rank{rank}.json").write_text(json.dumps(row))
    finally:
        dp.destroy()


def _ranks(parallel: dict) -> int:
    n = 1
    for v in parallel.values():
        n *= v
    return n


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(argv: list[str]) -> None:
    """In a fresh process: spawn the ranks of one configuration, print their rows as JSON."""
    import torch.multiprocessing as mp

    model_dir, mesh, length = argv[0], argv[1], int(argv[2])
    parallel = MESHES[mesh]
    world = _ranks(parallel)
    with tempfile.TemporaryDirectory(prefix="tidal-mesh-") as out:
        mp.spawn(worker, args=(world, _free_port(), model_dir, parallel, length, out), nprocs=world, join=True)
        rows = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    print(json.dumps(rows))


def _run_group(cmd: list[str], timeout: float, env: dict):
    """Run `cmd` in a process group of its own; past `timeout`, end the whole group (the ranks it
    spawned too, which would otherwise outlive it) and return None."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _summary(mesh: str, length: int, rows: list[dict], n_params: int) -> dict:
    worst = lambda k: round(max(r[k] for r in rows), 1)
    seconds = max(r["seconds"] for r in rows)
    return {"mesh": mesh, "parallel": MESHES[mesh], "ranks": len(rows), "length": length, "seconds": round(seconds, 1),
            "tokens_per_s": round(rows[0]["tokens"] / seconds, 1),
            **{k: worst(k) for k in ("state_mib", "params_mib", "grads_mib", "moments_mib", "resident_mib",
                                     "peak_fb_mib", "peak_step_mib", "activations_mib")},
            "expected": expected_mib(n_params, MESHES[mesh], length), "load": os.getloadavg()[0], "per_rank": rows}


def table(results: list[dict]) -> str:
    base = {r["length"]: r for r in results if r["mesh"] == "1"}
    lines = [("| L | mesh | ranks | state MiB/rank (x 1 rank) | activations MiB/rank (x 1 rank) | peak step MiB/rank "
              "(x 1 rank) | tokens/s (x 1 rank) |"), "|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        b = base.get(r["length"])
        x = (lambda k, r=r, b=b: f" ({r[k] / b[k]:.2f})" if b else "")
        lines.append(f"| {r['length']} | {r['mesh']} | {r['ranks']} | {r['state_mib']:.0f}{x('state_mib')} | "
                     f"{r['activations_mib']:.0f}{x('activations_mib')} | {r['peak_step_mib']:.0f}"
                     f"{x('peak_step_mib')} | {r['tokens_per_s']:.1f}{x('tokens_per_s')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "one":
        run_one(argv[1:])
        return
    p = argparse.ArgumentParser(description="one training step of a ~100M model on meshes of gloo ranks")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    p.add_argument("--timeout", type=float, default=3600, help="seconds for one configuration")
    p.add_argument("--max-mib", type=float, default=8192,
                   help="skip a configuration whose expected memory over all its ranks exceeds this")
    args = p.parse_args(argv)
    results = json.loads(RESULTS.read_text())["rows"] if RESULTS.exists() else []
    with tempfile.TemporaryDirectory(prefix="tidal-mesh-model-") as model_dir:
        n_params = build_model(Path(model_dir))
        print(f"model: {n_params / 1e6:.1f}M parameters", flush=True)
        for length in args.lengths:
            for mesh in args.meshes:
                exp = expected_mib(n_params, MESHES[mesh], length)
                ranks = _ranks(MESHES[mesh])
                need = ranks * (exp["state_mib"] + exp["activations_mib"] + 600)  # ~600 MiB: torch, libraries
                if need > args.max_mib:
                    print(f"skip L={length} {mesh}: expected {need} MiB over {ranks} ranks", flush=True)
                    continue
                cmd = [sys.executable, str(Path(__file__).parent / "parallel.py"), "mesh", "one", model_dir, mesh,
                       str(length)]
                env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
                load = os.getloadavg()[0]
                out = _run_group(cmd, args.timeout, env)
                if out is None:
                    print(f"L={length} {mesh}: no result in {args.timeout:.0f} s", flush=True)
                    continue
                if out.returncode:
                    print(f"L={length} {mesh} failed: {out.stderr[-2000:]}", flush=True)
                    continue
                row = _summary(mesh, length, json.loads(out.stdout.strip().splitlines()[-1]), n_params)
                row["load_before"] = load
                # read again: another run of this benchmark (other lengths, other meshes) may have written since
                results = json.loads(RESULTS.read_text())["rows"] if RESULTS.exists() else []
                results = [r for r in results if (r["mesh"], r["length"]) != (mesh, length)] + [row]
                RESULTS.parent.mkdir(exist_ok=True)
                RESULTS.write_text(json.dumps({"model": {**MODEL, "parameters": n_params}, "rows": results}, indent=1))
                print({k: v for k, v in row.items() if k != "per_rank"}, flush=True)
    print(table(sorted(results, key=lambda r: (r["length"], list(MESHES).index(r["mesh"])))))
