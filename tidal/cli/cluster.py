"""`tidal launch slurm|k8s` and `tidal plan`: put a training job on a cluster's scheduler, or
plan one (tidal/launch/, tidal/plan/).

The config is validated (with placement.mode=ray) before any script or manifest is written.
The planner's parser comes from tidal/plan/cli.py, which imports neither SimPy nor the runtime.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tidal.cli.common import split_args
from tidal.config import load_config
from tidal.launch.slurm import (
    SlurmJob,
    check_nodes,
    default_run_dir,
    node_resources,
    plan_nodes,
    prepare,
    render,
    submit,
)
from tidal.plan.cli import MissingPlanExtra
from tidal.plan.cli import add_parser as add_plan_parser  # imports neither SimPy nor the runtime


def cmd_launch_slurm(ns: argparse.Namespace) -> int:
    """Write an sbatch script that runs a Ray cluster and `tidal train` on it; submit it (tidal/launch/slurm.py)."""
    config, overrides = split_args(ns.args)
    cfg = load_config(config, [*overrides, "placement.mode=ray"])  # validated before anything is written
    trainer_nodes, engine_nodes = plan_nodes(cfg, ns.gpus_per_node)
    nodes = ns.nodes or trainer_nodes + engine_nodes
    check_nodes(cfg, nodes, ns.gpus_per_node)
    run_dir = default_run_dir(cfg)
    job = SlurmJob(configs=[Path(c).resolve() for c in config], overrides=overrides, run_dir=run_dir,
                   nodes=nodes, trainer_nodes=trainer_nodes, gpus_per_node=ns.gpus_per_node, partition=ns.partition,
                   time=ns.time, job_name=f"tidal-{cfg.run.name}", node_resources=node_resources(cfg, nodes, trainer_nodes))
    if ns.dry_run:
        print(render(job), end="")
        return 0
    script = prepare(job)
    job_id = submit(script)
    print(f"tidal: submitted Slurm job {job_id}: {nodes} node(s), run directory {run_dir}\n"
          f"  follow it: squeue -j {job_id}; tail -f {run_dir}/slurm-{job_id}.out; stop it: scancel {job_id}",
          file=sys.stderr)
    print(json.dumps({"job_id": job_id, "run_dir": str(run_dir), "script": str(script), "nodes": nodes}))
    return 0


def cmd_launch_k8s(ns: argparse.Namespace) -> int:
    """Print (or write) KubeRay manifests for the run: a ConfigMap and a RayJob or RayCluster (tidal/launch/k8s.py)."""
    from importlib.metadata import version

    from tidal.launch.k8s import K8sJob, manifests, parse_selector, render

    config, overrides = split_args(ns.args)
    cfg = load_config(config, [*overrides, "placement.mode=ray"])
    job = K8sJob(name=ns.name or f"tidal-{cfg.run.name}", image=ns.image, kind=ns.kind, gpus_per_node=ns.gpus_per_node,
                 cpus_per_node=ns.cpus_per_node, memory=ns.memory, nodes=ns.nodes, namespace=ns.namespace,
                 volume_claim=ns.volume_claim, run_root=ns.run_root, node_selector=parse_selector(ns.node_selector),
                 ray_version=version("ray"))
    text = render(manifests(cfg, job))
    if ns.out:
        Path(ns.out).write_text(text)
        print(f"tidal: wrote {ns.out}; start it with: kubectl apply -f {ns.out}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def plan_errors() -> tuple[type[Exception], ...]:
    from tidal.plan.spec import PlanSpecError  # yaml schemas of the planner: only when an error is met

    return MissingPlanExtra, PlanSpecError


def add_parsers(sub) -> None:
    """`tidal launch slurm|k8s` and `tidal plan`."""
    la = sub.add_parser("launch", help="run a training job on a cluster's scheduler (docs/clusters.md)")
    lsub = la.add_subparsers(dest="scheduler", required=True)
    s = lsub.add_parser("slurm", help="write and submit an sbatch script: a Ray cluster over the job's nodes, "
                        "`tidal train` on it, the cluster stopped with the job")
    s.add_argument("args", nargs="*", help="CONFIG.yaml and/or section.key=value overrides (as for `tidal train`)")
    s.add_argument("--nodes", type=int, default=None, help="nodes to allocate (default: what the config's trainer "
                   "and engine GPUs need at --gpus-per-node; 1 for a CPU job)")
    s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (#SBATCH --gpus-per-node; Ray's "
                   "--num-gpus); 0: a CPU job")
    s.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's default)")
    s.add_argument("--time", default=None, help="time limit, as sbatch --time takes it (e.g. 04:00:00)")
    s.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    s.set_defaults(fn=cmd_launch_slurm)
    k = lsub.add_parser("k8s", help="print KubeRay manifests (a ConfigMap and a RayJob or RayCluster) for "
                        "`kubectl apply -f`")
    k.add_argument("args", nargs="*", help="CONFIG.yaml and/or section.key=value overrides (as for `tidal train`)")
    k.add_argument("--image", required=True, help="the container image with tidal installed (every pod runs it)")
    k.add_argument("--kind", default="RayJob", choices=["RayJob", "RayCluster"], help="RayJob (default): the cluster "
                   "lives as long as the run; RayCluster: the cluster alone, the driver started on its head by hand")
    k.add_argument("--name", default=None, help="the resources' name (default: tidal-<run.name>)")
    k.add_argument("--namespace", default=None, help="Kubernetes namespace (default: kubectl's)")
    k.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per worker pod (nvidia.com/gpu); 0: CPU pods")
    k.add_argument("--cpus-per-node", type=int, default=8, help="CPUs per pod (requests = limits)")
    k.add_argument("--memory", default="32Gi", help="memory per pod (requests = limits)")
    k.add_argument("--nodes", type=int, default=None, help="worker pods (default: what the config's roles need)")
    k.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="a node label every worker pod needs (repeatable), e.g. a GPU node pool's")
    k.add_argument("--volume-claim", default="tidal-runs", help="a ReadWriteMany PersistentVolumeClaim every pod "
                   "mounts at --run-root (the run directory, checkpoints)")
    k.add_argument("--run-root", default="/runs", help="where the claim is mounted; run.dir must be under it "
                   "(default run.dir: RUN_ROOT/<run.name>)")
    k.add_argument("--out", default=None, help="write the manifests to this file instead of printing them")
    k.set_defaults(fn=cmd_launch_k8s)
    add_plan_parser(sub)
