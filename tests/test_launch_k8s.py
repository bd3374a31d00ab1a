"""`tidal launch k8s`: the KubeRay manifests for a config (fast; no cluster runs here).

Every pod template of the RayJob / RayCluster and the ConfigMap are validated against the
Kubernetes API's own JSON schemas (kubernetes-validate's, strict: an unknown field is an
error) with jsonschema; the ConfigMap's config loads back as the config that was checked; the
roles' pods follow the config (GPU counts, custom resources, node selectors, the shared
volume). The KubeRay-level fields (RayJob.spec, rayStartParams, workerGroupSpecs) are not
checked against KubeRay's CRD here: no package installable on this machine ships it
(docs/clusters.md says what was checked once and how)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tidal.cli import main
from tidal.config import ConfigError, load_config
from tidal.launch.k8s import K8sJob, manifests

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install 'tidal[k8s]'")

ROOT = Path(__file__).resolve().parents[1]
K8S_VERSION = "1.33.0"  # a Kubernetes release KubeRay 1.5 supports; the schemas are kubernetes-validate's
GPU = ROOT / "examples/ray/gpu_cluster.yaml"


def check_pod_template(template: dict) -> None:
    """Validate one pod template as the PodTemplate object the API server would see it in."""
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                  "template": template}, K8S_VERSION, strict=True)


def templates(doc: dict) -> list[dict]:
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]


def gpu_job(**kw) -> list[dict]:
    job = K8sJob(name="math", image="ghcr.io/example/tidal:1", gpus_per_node=8, node_selector={"pool": "h100"},
                 run_root="/shared", **kw)
    return manifests(load_config(GPU), job)


@pytest.mark.parametrize("kind", ["RayJob", "RayCluster"])
def test_every_pod_template_and_the_configmap_pass_the_kubernetes_schemas(kind):
    config_map, ray = gpu_job(kind=kind)
    assert (ray["apiVersion"], ray["kind"]) == ("ray.io/v1", kind)
    kubernetes_validate.validate(config_map, K8S_VERSION, strict=True)
    for template in templates(ray):
        check_pod_template(template)
    # the control: the same validation rejects a misspelt field, and a container without its required name
    bad = json.loads(json.dumps(templates(ray)[1]))
    bad["spec"]["nodeSelecter"] = bad["spec"].pop("nodeSelector")
    with pytest.raises(kubernetes_validate.ValidationError, match="nodeSelecter"):
        check_pod_template(bad)
    bad = json.loads(json.dumps(templates(ray)[1]))
    del bad["spec"]["containers"][0]["name"]
    with pytest.raises(kubernetes_validate.ValidationError, match="'name' is a required property"):
        check_pod_template(bad)


def test_the_pods_follow_the_configs_roles():
    _, job = gpu_job()
    spec = job["spec"]
    assert spec["entrypoint"] == "python -m tidal.cli train /etc/tidal/config.yaml"
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"] == {"num-cpus": "0"}  # the driver's pod holds no role
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    # gpu_cluster.yaml: 8 trainer ranks and 8 engine replicas, one GPU each, pinned by custom resources
    assert sorted(groups) == ["engine", "trainer"]
    for name, resource in (("trainer", "trainer_node"), ("engine", "engine_node")):
        g = groups[name]
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == 1
        assert g["rayStartParams"]["resources"] == f"'{json.dumps({resource: 8.0})}'"
        pod = g["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert pod["nodeSelector"] == {"pool": "h100"}
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "tidal-runs"
        assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == "/shared"


def test_the_configmap_holds_the_checked_config_joining_the_cluster(tmp_path):
    config_map, _ = gpu_job()
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    cfg = load_config(path)
    want = load_config(GPU)
    assert (cfg.placement.mode, cfg.placement.address) == ("ray", "auto")
    assert cfg.run.dir == want.run.dir == "/shared/runs/math-grpo-16gpu"
    assert cfg.model_dump(exclude={"placement": {"address"}}) == want.model_dump(exclude={"placement": {"address"}})


def test_a_cpu_config_is_one_group_of_cpu_pods():
    _, job = manifests(load_config(overrides=["placement.mode=ray", "placement.trainer_ranks=2"]), K8sJob(name="t", image="i:1"))
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["groupName"] == "workers" and group["replicas"] == 1
    assert "nvidia.com/gpu" not in group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]


@pytest.mark.parametrize("job, config, message", [
    (K8sJob(name="t", image="i:1", run_root="/runs"), GPU, "not on the shared volume mounted at /runs"),
    (K8sJob(name="t", image="i:1", gpus_per_node=8, run_root="/shared", nodes=1), GPU, "reserve 16"),
    (K8sJob(name="t", image="i:1", kind="Deployment"), None, "--kind Deployment"),
])
def test_bad_input_is_named(job, config, message):
    with pytest.raises(ConfigError, match=message):
        manifests(load_config(config), job)


def test_the_cli_prints_yaml_that_kubectl_reads(capsys, tmp_path):
    assert main(["launch", "k8s", str(GPU), "--image", "ghcr.io/example/tidal:1", "--gpus-per-node", "8",
                 "--run-root", "/shared", "--node-selector", "pool=h100", "--kind", "RayCluster", "--name", "math"]) == 0
    out = capsys.readouterr().out
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "RayCluster"]
    want = gpu_job(kind="RayCluster")
    want[1]["spec"]["rayVersion"] = docs[1]["spec"]["rayVersion"]  # the CLI names the installed Ray
    assert docs == want  # what the function makes, read back by a YAML reader
    assert "&id" not in out  # no YAML anchors: every part written out
    assert main(["launch", "k8s", "--image", "i:1", "--node-selector", "pool"]) == 2
    assert "--node-selector 'pool'" in capsys.readouterr().err
