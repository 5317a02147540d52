"""deploy/: Serve configs and KubeRay manifests, checked offline against the real schemas.

No Kubernetes runs here, so every manifest is validated against the KubeRay CRDs in
../shared/data/kuberay (strictly: an unknown field is an error, as with `kubectl apply
--validate=strict`, where the API server would otherwise prune it silently), against the
KubeRay operator's own admission rules that the CRD cannot express, and against this
project: Ray Serve's config schema, ServiceConfig, the app's deployment names, the image.
"""

import copy
import gzip
import importlib
import re
import shlex
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.runtime_env import RuntimeEnv
from ray.serve._private.build_app import build_app as build_deployments  # what `serve build` runs
from ray.serve.schema import ServeDeploySchema

from cluster.config import ServiceConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
KUBERAY = DEPLOY / "kuberay"
SERVE_CONFIG_FILES = (DEPLOY / "serve_config.yaml", KUBERAY / "serve_config.yaml")
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml.gz", "RayJob": "ray.io_rayjobs.yaml.gz",
             "RayService": "ray.io_rayservices.yaml.gz"}
# What deploy/kuberay may hold; anything else (an Ingress, a LoadBalancer...) needs a review.
KNOWN_KINDS = {"RayService", "RayCluster", "RayJob", "Deployment", "Service", "PersistentVolumeClaim"}
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME_CHARS = {"RayCluster": 53, "RayService": 47, "RayJob": 47}  # KubeRay utils/constant.go


def _documents(path):
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


MANIFESTS = [(f"{path.name}:{doc['kind']}", doc) for path in sorted(KUBERAY.glob("*.yaml"))
             if path.name != "serve_config.yaml" for doc in _documents(path)]


def _of_kind(*kinds):
    return [doc for _, doc in MANIFESTS if doc["kind"] in kinds]


def _cluster_specs():
    """(name, RayCluster spec, annotations) of every Ray cluster the manifests create."""
    specs = []
    for doc in _of_kind("RayService", "RayCluster", "RayJob"):
        spec = doc["spec"].get("rayClusterConfig", doc["spec"]) if doc["kind"] != "RayJob" \
            else doc["spec"].get("rayClusterSpec")
        if spec is not None:
            specs.append((doc["metadata"]["name"], spec, doc["metadata"].get("annotations", {})))
    return specs


def _serve_configs():
    configs = [(path.relative_to(REPO_ROOT).as_posix(), yaml.safe_load(path.read_text()))
               for path in SERVE_CONFIG_FILES]
    configs += [(f"RayService {doc['metadata']['name']}", yaml.safe_load(doc["spec"]["serveConfigV2"]))
                for doc in _of_kind("RayService")]
    return configs


def _applications():
    return [(f"{label}:{app['name']}", app) for label, config in _serve_configs() for app in config["applications"]]


def _groups(spec):
    return [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]


def _pod_specs():
    """(label, pod spec) of every pod the manifests run: each Ray group, each Deployment."""
    pods = [(f"{name}/{group.get('groupName', 'head')}", group["template"]["spec"])
            for name, spec, _ in _cluster_specs() for group in _groups(spec)]
    return pods + [(doc["metadata"]["name"], doc["spec"]["template"]["spec"]) for doc in _of_kind("Deployment")]


def _ray_containers(spec):
    return [group["template"]["spec"]["containers"][0] for group in _groups(spec)]  # KubeRay: index 0 runs Ray


def _group(spec, name):
    return next(group for group in spec["workerGroupSpecs"] if group["groupName"] == name)


def _strict(schema):
    """The CRD schema with unknown fields rejected wherever Kubernetes would prune them."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if ("properties" in strict and "additionalProperties" not in strict
            and not strict.get("x-kubernetes-preserve-unknown-fields")):
        strict["additionalProperties"] = False
    return strict


@pytest.fixture(scope="module")
def crd_validators(shared_data):
    """kind -> (apiVersion, validator) from the served, stored version of each CRD."""
    validators = {}
    for kind, file_name in CRD_FILES.items():
        with gzip.open(shared_data / "kuberay" / file_name, "rt") as handle:
            crd = yaml.safe_load(handle)
        assert crd["spec"]["names"]["kind"] == kind
        version = next(v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage"))
        schema = _strict(version["schema"]["openAPIV3Schema"])
        # x-kubernetes-* keys are annotations to a Draft 7 validator (CEL rules are not run;
        # the operator rules below cover what they would catch for these manifests).
        jsonschema.Draft7Validator.check_schema(schema)
        validators[kind] = (f"{crd['spec']['group']}/{version['name']}", jsonschema.Draft7Validator(schema))
    return validators


def _schema_errors(validator, doc):
    return sorted(f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(doc))


def _operator_errors(spec, annotations):
    """The rules of KubeRay's ValidateRayClusterSpec (ray-operator/controllers/ray/utils/validation.go) that apply."""
    errors = []
    head = spec["headGroupSpec"]
    head_env = {item["name"] for item in head["template"]["spec"]["containers"][0].get("env", [])}
    for group in _groups(spec):
        name = group.get("groupName", "head")
        start_resources = {"num-cpus", "num-gpus", "memory", "resources"} & set(group.get("rayStartParams", {}))
        if start_resources and group.get("resources"):
            errors.append(f"{name}: resources in both rayStartParams and resources")
        if group is head:
            continue
        if not group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]:
            errors.append(f"{name}: need minReplicas <= replicas <= maxReplicas")
    if "gcsFaultToleranceOptions" in spec:
        if "ray.io/ft-enabled" in annotations:
            errors.append("ray.io/ft-enabled annotation together with gcsFaultToleranceOptions")
        if "redis-password" in head.get("rayStartParams", {}):
            errors.append("redis-password in rayStartParams with gcsFaultToleranceOptions")
        errors += [f"{env} env on the head with gcsFaultToleranceOptions"
                   for env in sorted({"REDIS_PASSWORD", "RAY_REDIS_ADDRESS"} & head_env)]
    elif "RAY_REDIS_ADDRESS" in head_env:
        errors.append("RAY_REDIS_ADDRESS without gcsFaultToleranceOptions")
    return errors


def test_deploy_holds_the_three_ray_kinds_and_nothing_unexpected():
    kinds = [doc["kind"] for _, doc in MANIFESTS]
    assert {"RayService", "RayCluster", "RayJob"} <= set(kinds) <= KNOWN_KINDS, kinds


@pytest.mark.parametrize("doc", [pytest.param(doc, id=label) for label, doc in MANIFESTS if doc["kind"] in CRD_FILES])
def test_ray_manifest_matches_the_kuberay_crd(crd_validators, doc):
    api_version, validator = crd_validators[doc["kind"]]
    assert doc["apiVersion"] == api_version
    assert _schema_errors(validator, doc) == []
    name = doc["metadata"]["name"]
    assert DNS_1035.match(name) and len(name) <= MAX_NAME_CHARS[doc["kind"]], name


def test_schema_check_rejects_a_wrong_type_and_an_unknown_field(crd_validators):
    _, validator = crd_validators["RayService"]
    service = _of_kind("RayService")[0]
    wrong_type = copy.deepcopy(service)
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "eight"
    assert any("workerGroupSpecs/0/maxReplicas" in e and "not of type 'integer'" in e
               for e in _schema_errors(validator, wrong_type))
    typo = copy.deepcopy(service)
    typo["spec"]["rayClusterConfig"]["enableInTreeAutoScaling"] = typo["spec"]["rayClusterConfig"].pop(
        "enableInTreeAutoscaling")
    assert any("enableInTreeAutoScaling" in e for e in _schema_errors(validator, typo))


def test_ray_clusters_pass_the_operator_rules():
    for name, spec, annotations in _cluster_specs():
        assert _operator_errors(spec, annotations) == [], name
    name, spec, annotations = _cluster_specs()[0]
    broken = copy.deepcopy(spec)  # the rule check itself must be able to fail
    broken["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].append({"name": "REDIS_PASSWORD", "value": "x"})
    assert _operator_errors(broken, annotations) == ["REDIS_PASSWORD env on the head with gcsFaultToleranceOptions"]


@pytest.mark.parametrize("config", [pytest.param(config, id=label) for label, config in _serve_configs()])
def test_serve_config_matches_rays_schema(config):
    ServeDeploySchema.model_validate(config)


def test_rayservice_embeds_the_kuberay_serve_config_verbatim():
    file_config = yaml.safe_load((KUBERAY / "serve_config.yaml").read_text())
    for doc in _of_kind("RayService"):
        assert yaml.safe_load(doc["spec"]["serveConfigV2"]) == file_config


@pytest.mark.parametrize("app", [pytest.param(app, id=label) for label, app in _applications()])
def test_application_builds_from_its_import_path_args_and_overrides(app):
    module_name, _, attribute = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module_name), attribute)
    assert callable(builder)
    config = ServiceConfig(**app["args"])
    # A Redis URL that is never dialled: building binds deployments and connects nowhere.
    built = build_deployments(builder({**app["args"], "redis_url": "redis://127.0.0.1:1/0"}), name=app["name"])
    names = {deployment.name for deployment in built.deployments}
    overrides = {deployment["name"]: deployment for deployment in app.get("deployments", [])}
    assert set(overrides) <= names, f"overrides {sorted(overrides)} vs app deployments {sorted(names)}"
    assert "autoscaling_config" in overrides["router"]
    # Predictions run inside the router unless the config asks for the predictor deployment.
    assert ("length_predictor" in names) == (config.predictor_mode == "deployment")
    # Scale out before a router replica starts refusing with 429.
    assert overrides["router"]["autoscaling_config"]["target_ongoing_requests"] < config.max_concurrent_requests
    runtime_env = app.get("runtime_env", {})
    RuntimeEnv(**runtime_env)
    # The project comes installed (venv or image); nothing is fetched or uploaded at start.
    assert not {"pip", "uv", "conda", "working_dir", "py_modules"} & set(runtime_env), runtime_env


def test_binds_this_machine_locally_and_the_pod_network_in_kubernetes():
    for label, config in _serve_configs():
        expected = "127.0.0.1" if label == "deploy/serve_config.yaml" else "0.0.0.0"
        assert config["http_options"]["host"] == expected, label
        for app in config["applications"]:
            assert not {"host", "port"} & set(app["args"]), "Serve's http_options decide the bind, not args"
    serve_port = yaml.safe_load((KUBERAY / "serve_config.yaml").read_text())["http_options"]["port"]
    for name, spec, _ in _cluster_specs():
        ports = {port["name"]: port["containerPort"] for port in _ray_containers(spec)[0]["ports"]}
        assert ports["serve"] == serve_port, name  # KubeRay's Serve Service targets the `serve` port
    # Nothing binds the node's own network, and Redis stays inside the cluster.
    for label, pod in _pod_specs():
        assert not pod.get("hostNetwork"), label
        assert all("hostPort" not in port for c in pod["containers"] for port in c.get("ports", [])), label
    assert all(service["spec"].get("type", "ClusterIP") == "ClusterIP" for service in _of_kind("Service"))


def test_gpu_group_asks_for_gpus_and_bounds_the_worker_pool():
    args = yaml.safe_load((KUBERAY / "serve_config.yaml").read_text())["applications"][0]["args"]
    config = ServiceConfig(**args)
    assert config.worker_num_gpus > 0
    for name, spec, _ in _cluster_specs():
        assert spec["enableInTreeAutoscaling"] is True, name
        gpu_group = _group(spec, "gpu-workers")
        container = gpu_group["template"]["spec"]["containers"][0]
        gpus_per_pod = int(container["resources"]["limits"]["nvidia.com/gpu"])
        # A worker's ranks are one STRICT_PACK placement group: all of them on one Ray node, here one pod.
        gpus_per_worker = config.tensor_parallel_size * config.worker_num_gpus
        assert gpus_per_pod >= 1 and gpus_per_worker <= gpus_per_pod
        assert config.max_workers_resolved <= gpu_group["maxReplicas"] * (gpus_per_pod // gpus_per_worker)
        assert config.tensor_parallel_size * config.worker_num_cpus <= float(container["resources"]["limits"]["cpu"])
        assert any(t["key"] == "nvidia.com/gpu" for t in gpu_group["template"]["spec"].get("tolerations", []))
        # Only the GPU group holds GPUs, so CPU-only replicas never keep a GPU node alive.
        others = [c for c in _ray_containers(spec) if c is not container]
        assert all("nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}) for c in others), name


def test_redis_wiring_points_at_the_redis_manifest():
    (service,) = _of_kind("Service")
    (deployment,) = _of_kind("Deployment")
    (claim,) = _of_kind("PersistentVolumeClaim")
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert claim["metadata"]["name"] in {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]}
    address = f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    (secret,) = [e["valueFrom"]["secretKeyRef"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == "REDIS_PASSWORD"]
    databases = []
    for name, spec, _ in _cluster_specs():
        cluster_databases = set()
        ft = spec["gcsFaultToleranceOptions"]
        assert ft["redisAddress"] == address and ft["redisPassword"]["valueFrom"]["secretKeyRef"] == secret, name
        for container in _ray_containers(spec):
            env = [item["name"] for item in container["env"]]
            values = {item["name"]: item for item in container["env"]}
            # Kubernetes expands $(VAR) only from variables defined earlier in the list.
            assert env.index("S3_REDIS_PASSWORD") < env.index("S3_REDIS_URL"), name
            assert values["S3_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == secret
            url = re.fullmatch(r"redis://:\$\(S3_REDIS_PASSWORD\)@([^/]+)/(\d+)", values["S3_REDIS_URL"]["value"])
            assert url and url[1] == address, values["S3_REDIS_URL"]
            cluster_databases.add(int(url[2]))
        assert len(cluster_databases) == 1, (name, cluster_databases)  # one ledger per cluster
        databases += cluster_databases
    # GCS uses database 0; each cluster's controller ledger gets its own.
    assert 0 not in databases and len(set(databases)) == len(databases), databases


def test_every_ray_container_runs_the_project_image_built_on_the_same_ray():
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", dockerfile, re.MULTILINE)
    for name, spec, _ in _cluster_specs():
        assert spec["rayVersion"] == ray.__version__, name
        assert base == f"rayproject/ray:{spec['rayVersion']}-py311-gpu"
        assert {c["image"] for c in _ray_containers(spec)} == {f"s3serve:{version}"}, name


def _rollout_command():
    (job,) = _of_kind("RayJob")
    workdir = re.search(r"^WORKDIR (\S+)", (KUBERAY / "Dockerfile").read_text(), re.MULTILINE)[1]
    return job, shlex.split(job["spec"]["entrypoint"]), workdir


def test_rollout_job_targets_the_raycluster_with_a_config_in_the_image():
    job, argv, workdir = _rollout_command()
    assert argv[:3] == ["python", "-m", "deploy.rollout"] and argv[3] == "--config", argv
    config_path = argv[4]
    assert config_path.startswith(workdir + "/"), "the config must come from the project copy in the image"
    local = REPO_ROOT / config_path.removeprefix(workdir + "/")
    assert local.is_file() and local in SERVE_CONFIG_FILES, local
    (cluster,) = _of_kind("RayCluster")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}


def test_rollout_entrypoint_module_exists():
    _, argv, _ = _rollout_command()
    assert (REPO_ROOT / (argv[2].replace(".", "/") + ".py")).is_file()
