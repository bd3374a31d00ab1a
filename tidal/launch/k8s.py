"""Kubernetes: KubeRay manifests for a run (`tidal launch k8s`), a pure function of the config
and the flags; tidal applies nothing itself (`kubectl apply -f` does).

The choice: KubeRay's own resources, not pods of tidal's making. A `RayJob` (the default)
makes a Ray cluster for the run, runs the driver as its entrypoint and deletes the cluster
when the job ends; a `RayCluster` is the cluster alone, for a person who runs the driver on
its head (docs/clusters.md). Beside it a ConfigMap holds the run's whole config, validated
here, so the pods run exactly what was checked: `placement.mode=ray`, `placement.address=auto`
(the driver joins the cluster KubeRay started), and `run.dir` on the shared volume.

The pods, from the config's roles (as `tidal launch slurm` plans its nodes, slurm.plan_nodes):
- the head: the driver, Ray's GCS, no role (`num-cpus: 0`, so no actor lands beside the driver);
- a `trainer` worker group, and an `engine` group where the config pins the roles to node
  types with distinct custom resources (`placement.trainer.resources: {trainer_node: 1}`):
  each pod is one node with --gpus-per-node GPUs (`nvidia.com/gpu`) and offers its role's
  custom resources (Ray's `--resources`), so Ray's placement puts each role on its pods;
- every pod mounts the shared volume (a ReadWriteMany PersistentVolumeClaim the cluster has)
  at the run root: checkpoints written by trainer ranks on any pod are the run's.
Node selectors pin the worker groups to GPU node pools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import yaml

from tidal.config import ConfigError, TidalConfig, dump_config
from tidal.launch.slurm import check_nodes, node_resources, plan_nodes

API_VERSION = "ray.io/v1"
CONFIG_DIR = "/etc/tidal"
KINDS = ("RayJob", "RayCluster")


@dataclass
class K8sJob:
    """What `tidal launch k8s` generates, from its flags."""

    name: str
    image: str
    kind: str = "RayJob"
    gpus_per_node: int = 0
    cpus_per_node: int = 8
    memory: str = "32Gi"
    nodes: int | None = None  # worker pods in all; None: what the config's roles need
    namespace: str | None = None
    volume_claim: str = "tidal-runs"
    run_root: str = "/runs"
    node_selector: dict[str, str] = field(default_factory=dict)  # every worker pod
    ray_version: str = ""


def parse_selector(items: list[str]) -> dict[str, str]:
    """`key=value` items (--node-selector) as a dict; a malformed one is named."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--node-selector {item!r}: expected KEY=VALUE (e.g. cloud.google.com/gke-accelerator=nvidia-h100-80gb)")
        out[key] = value
    return out


def run_config(cfg: TidalConfig, job: K8sJob) -> TidalConfig:
    """The config the pods run: Ray, joining KubeRay's cluster, the run directory on the volume."""
    data = cfg.model_dump()
    data["placement"].update(mode="ray", address="auto")
    run_dir = data["run"]["dir"] or f"{job.run_root}/{cfg.run.name}"
    if not (run_dir == job.run_root or run_dir.startswith(job.run_root.rstrip("/") + "/")):
        raise ConfigError(f"run.dir={run_dir} is not on the shared volume mounted at {job.run_root} (--run-root): "
                          f"the trainer ranks' pods write checkpoints there")
    data["run"]["dir"] = run_dir
    try:
        return TidalConfig.model_validate(data)
    except ValueError as e:
        raise ConfigError(f"the config for Kubernetes: {e}") from None


def _container(job: K8sJob, name: str, gpus: int, cpus: int, mounts: list[dict]) -> dict:
    resources = {"cpu": str(cpus), "memory": job.memory}
    if gpus:
        resources["nvidia.com/gpu"] = str(gpus)
    return {"name": name, "image": job.image, "imagePullPolicy": "IfNotPresent",
            "resources": {"requests": dict(resources), "limits": dict(resources)},
            "volumeMounts": mounts,
            # Ray's object store lives in /dev/shm: KubeRay mounts a memory-backed one of its own.
            "env": [{"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}]}


def _template(job: K8sJob, container: dict, volumes: list[dict], selector: dict[str, str]) -> dict:
    spec = {"containers": [container], "volumes": volumes}
    if selector:
        spec["nodeSelector"] = dict(selector)
    return {"metadata": {"labels": {"app.kubernetes.io/name": "tidal", "tidal/run": job.name}}, "spec": spec}


def cluster_spec(cfg: TidalConfig, job: K8sJob) -> dict:
    """The RayCluster spec (also a RayJob's rayClusterSpec)."""
    trainer_nodes, engine_nodes = plan_nodes(cfg, job.gpus_per_node)
    nodes = job.nodes or trainer_nodes + engine_nodes
    check_nodes(cfg, nodes, job.gpus_per_node)
    per_node = node_resources(cfg, nodes, trainer_nodes)
    runs = {"name": "runs", "persistentVolumeClaim": {"claimName": job.volume_claim}}
    runs_mount = {"name": "runs", "mountPath": job.run_root}
    config = {"name": "config", "configMap": {"name": f"{job.name}-config"}}
    config_mount = {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}
    # The head's dashboard takes the RayJob's submission from KubeRay's submitter pod, inside the cluster.
    head = {"rayStartParams": {"num-cpus": "0"},
            "template": _template(job, _container(job, "ray-head", 0, job.cpus_per_node, [runs_mount, config_mount]),
                                  [runs, config], {})}
    # Where the roles are pinned to node types, a group of pods for each; else one group.
    split = nodes > trainer_nodes and per_node[0] != per_node[-1]
    groups = [("trainer", per_node[0], trainer_nodes), ("engine", per_node[-1], nodes - trainer_nodes)] if split \
        else [("workers", per_node[0], nodes)]
    workers = []
    for name, res, count in groups:
        params = {"num-cpus": str(job.cpus_per_node)}
        if res:
            params["resources"] = f"'{json.dumps(res, sort_keys=True)}'"  # a shell word: KubeRay passes it to ray start
        workers.append({"groupName": name, "replicas": count, "minReplicas": count, "maxReplicas": count,
                        "rayStartParams": params,
                        "template": _template(job, _container(job, "ray-worker", job.gpus_per_node, job.cpus_per_node,
                                                              [runs_mount]), [runs], job.node_selector)})
    spec = {"headGroupSpec": head, "workerGroupSpecs": workers}
    if job.ray_version:
        spec["rayVersion"] = job.ray_version
    return spec


def manifests(cfg: TidalConfig, job: K8sJob) -> list[dict]:
    """The ConfigMap of the run's config, and the RayJob (or RayCluster) that runs it."""
    if job.kind not in KINDS:
        raise ConfigError(f"--kind {job.kind}: one of {', '.join(KINDS)}")
    run_cfg = run_config(cfg, job)
    meta = {"name": job.name, "labels": {"app.kubernetes.io/name": "tidal"}}
    if job.namespace:
        meta["namespace"] = job.namespace
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {**meta, "name": f"{job.name}-config"},
                  "data": {"config.yaml": dump_config(run_cfg)}}
    spec = cluster_spec(run_cfg, job)
    if job.kind == "RayCluster":
        return [config_map, {"apiVersion": API_VERSION, "kind": "RayCluster", "metadata": meta, "spec": spec}]
    entrypoint = f"python -m tidal.cli train {CONFIG_DIR}/config.yaml"
    return [config_map, {"apiVersion": API_VERSION, "kind": "RayJob", "metadata": meta, "spec": {
        "entrypoint": entrypoint, "submissionMode": "K8sJobMode", "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": 3600, "backoffLimit": 0, "rayClusterSpec": spec}}]


class _Plain(yaml.SafeDumper):
    """Every shared part written out in full (no &anchors): manifests people read and edit."""

    def ignore_aliases(self, data) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str):
    """Text of several lines (the ConfigMap's config.yaml) as a block, as a person would write it."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Plain.add_representer(str, _text)


def render(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Plain, sort_keys=False)
