"""Offline checks of everything under deploy/: KubeRay CRD schemas, Serve's schema, and that the files agree.

The KubeRay v1.7.0 CRDs are third-party data read by path (../shared/data/kuberay; never copied here). Every YAML
file under deploy/ must validate strictly (unknown fields rejected); deliberately broken copies must fail with the
offending field's path in the message. The Serve configs must load the way ``dspark serve --config`` loads them and
the way ``serve deploy`` / KubeRay build them (Serve's own builder call), and the RayService must embed
deploy/serve_config.gpu.yaml verbatim.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import shared_path

from cluster.autoscaling import POLICY_PATH
from cluster.config import AppConfig
from cluster.serve_cmd import load_serve_config
from deploy import render, validate

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
YAML_FILES = sorted(DEPLOY.glob("*.yaml"))
SERVE_CONFIGS = [DEPLOY / name for name in ("serve_config.yaml", "serve_config.gpu.yaml",
                                             "serve_config.colocated.gpu.yaml")]


@pytest.fixture(scope="module")
def schemas() -> dict[tuple[str, str], dict[str, Any]]:
    return validate.load_crd_schemas(shared_path("data/kuberay"))


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())


def test_deploy_folder_holds_the_expected_files() -> None:
    names = {p.name for p in YAML_FILES}
    assert {"rayservice.yaml", "serve_config.yaml", "serve_config.gpu.yaml"} <= names


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_every_manifest_validates(path: Path, schemas: dict) -> None:
    assert validate.file_errors(path, schemas) == []


def test_strict_schema_rejects_unknown_fields_everywhere(schemas: dict) -> None:
    schema = schemas[("ray.io/v1", "RayService")]
    worker = schema["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"]["workerGroupSpecs"]["items"]
    assert worker["additionalProperties"] is False
    container = worker["properties"]["template"]["properties"]["spec"]["properties"]["containers"]["items"]
    assert container["additionalProperties"] is False
    # Maps keep their value schema (labels, resources, rayStartParams are string maps, not closed objects).
    assert worker["properties"]["resources"]["additionalProperties"] == {"type": "string"}
    assert ("ray.io/v1", "RayCluster") in schemas


def _worker(doc: dict, index: int) -> dict:
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][index]


def _container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


def _set_serve(doc: dict, old: str, new: str) -> None:
    assert old in doc["spec"]["serveConfigV2"]
    doc["spec"]["serveConfigV2"] = doc["spec"]["serveConfigV2"].replace(old, new, 1)


BROKEN = {
    "unknown container field": (
        lambda d: _container(_worker(d, 1)).update(resourcez={}),
        "spec.rayClusterConfig.workerGroupSpecs[1].template.spec.containers[0]: Additional properties are not "
        "allowed ('resourcez' was unexpected)",
    ),
    "unknown cluster field": (
        lambda d: d["spec"]["rayClusterConfig"].update(enableInTreeAutoscalingg=True),
        "spec.rayClusterConfig: Additional properties are not allowed ('enableInTreeAutoscalingg' was unexpected)",
    ),
    "wrong type": (
        lambda d: _worker(d, 0).update(maxReplicas="four"),
        "spec.rayClusterConfig.workerGroupSpecs[0].maxReplicas: 'four' is not of type 'integer'",
    ),
    "missing required": (
        lambda d: _worker(d, 0).pop("groupName"),
        "spec.rayClusterConfig.workerGroupSpecs[0]: 'groupName' is a required property",
    ),
    "bad quantity": (
        lambda d: _container(_worker(d, 0))["resources"]["limits"].update(memory="48 GB"),
        "spec.rayClusterConfig.workerGroupSpecs[0].template.spec.containers[0].resources.limits.memory: '48 GB' "
        "does not match",
    ),
    "bad enum": (
        lambda d: d["spec"]["rayClusterConfig"]["autoscalerOptions"].update(upscalingMode="Fast"),
        "spec.rayClusterConfig.autoscalerOptions.upscalingMode: 'Fast' is not one of",
    ),
    "unknown app arg": (
        lambda d: _set_serve(d, "max_requests: 64", "max_requestz: 64"),
        "spec.serveConfigV2.applications[0].args.engine.max_requestz: Extra inputs are not permitted",
    ),
    "unknown autoscaling field": (
        lambda d: _set_serve(d, "upscale_delay_s: 30", "upscale_delay: 30"),
        "spec.serveConfigV2.applications[0].deployments[0].autoscaling_config.upscale_delay: unknown field",
    ),
    "policy that does not import": (
        lambda d: _set_serve(d, "engine_load_policy", "no_such_policy"),
        "spec.serveConfigV2.applications[0].deployments[0].autoscaling_config.policy: cannot be imported",
    ),
    "target a full replica never reaches": (
        lambda d: _set_serve(d, "target_ongoing_requests: 48", "target_ongoing_requests: 64"),
        "spec.serveConfigV2.applications[0].deployments[0].autoscaling_config.target_ongoing_requests: 64.0 must "
        "be below engine.max_requests (64)",
    ),
    "pool advertised nowhere": (
        lambda d: _worker(d, 0).update(resources={"verify_pool": "1"}),
        "spec.rayClusterConfig.workerGroupSpecs: exactly one group must advertise 'draft_pool' (the Drafter pool)",
    ),
    "too few pods for max_replicas": (
        lambda d: _worker(d, 1).update(maxReplicas=2),
        "spec.rayClusterConfig.workerGroupSpecs[1].maxReplicas: 2 pods of 1 Verifier replicas each cannot hold "
        "the deployment's max_replicas 4",
    ),
    "pool pod without a GPU": (
        lambda d: [_container(_worker(d, 0))["resources"][k].pop("nvidia.com/gpu") for k in ("limits", "requests")],
        "spec.rayClusterConfig.workerGroupSpecs[0].resources: a pod cannot host one Drafter replica",
    ),
    "models not mounted": (
        lambda d: _container(_worker(d, 1)).update(volumeMounts=[]),
        "spec.rayClusterConfig.workerGroupSpecs[1].template.spec.containers[0].volumeMounts: models.target "
        "/models/target is not on a mounted PersistentVolumeClaim",
    ),
    "cache folder not set": (
        lambda d: _container(_worker(d, 1)).update(env=[e for e in _container(_worker(d, 1))["env"]
                                                        if e["name"] != "DSPARK_CACHE_DIR"]),
        "spec.rayClusterConfig.workerGroupSpecs[1].template.spec.containers[0].env: no cache folder",
    ),
    "cache folder not on a claim": (
        lambda d: _set_serve(d, "      model_name:", "      cache_dir: /tmp/cache\n      model_name:"),
        "spec.rayClusterConfig.workerGroupSpecs[0].template.spec.containers[0].volumeMounts: the cache folder "
        "/tmp/cache is not on a writable PersistentVolumeClaim",
    ),
    "cache claim read-only": (
        lambda d: [m.update(readOnly=True) for m in _container(_worker(d, 0))["volumeMounts"] if m["name"] == "cache"],
        "spec.rayClusterConfig.workerGroupSpecs[0].template.spec.containers[0].volumeMounts: the cache folder "
        "/cache/dspark is not on a writable PersistentVolumeClaim",
    ),
    "secret variable missing": (
        lambda d: _container(d["spec"]["rayClusterConfig"]["headGroupSpec"]).update(env=[]),
        "spec.rayClusterConfig.headGroupSpec.template.spec.containers[0].env: DSPARK_API_KEY is not set",
    ),
    "no application readiness probe": (
        lambda d: _container(d["spec"]["rayClusterConfig"]["headGroupSpec"]).pop("readinessProbe"),
        "spec.rayClusterConfig.headGroupSpec.template.spec.containers[0].readinessProbe: no readiness probe of the "
        "application",
    ),
    "probe on another port": (
        lambda d: _set_serve(d, "port: 8000", "port: 8001"),
        "spec.rayClusterConfig.headGroupSpec.template.spec.containers[0].readinessProbe: the probe must ask the "
        "serve port's /health (:8001/health)",
    ),
    "spares on a pod that does not preload": (
        lambda d: _container(_worker(d, 0)).update(env=[e for e in _container(_worker(d, 0))["env"]
                                                        if e["name"] != "RAY_preload_python_modules"]),
        "spec.rayClusterConfig.workerGroupSpecs[0].template.spec.containers[0].env: RAY_preload_python_modules must "
        "be 'torch,ray.serve._private.replica,cluster.app' for args.spare_workers",
    ),
    "serveConfigV2 not YAML": (
        lambda d: d["spec"].update(serveConfigV2="applications: [\n"),
        "spec.serveConfigV2: not YAML",
    ),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_rayservice_fails_with_the_offending_path(name: str, schemas: dict, rayservice: dict) -> None:
    mutate, expected = BROKEN[name]
    doc = copy.deepcopy(rayservice)
    mutate(doc)
    errors = validate.document_errors(doc, schemas)
    assert any(error.startswith(expected) for error in errors), errors


@pytest.mark.filterwarnings("ignore::FutureWarning")  # Serve warns too, before the validator reports it
@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        pytest.param(lambda c: c.update(http_optionz={}),
                     "http_optionz: unknown field (not in Serve's ServeDeploySchema)", id="unknown-top-level"),
        pytest.param(lambda c: c["applications"][0]["deployments"][1].update(name="Drafterr"),
                     "applications[0].deployments[1].name: 'Drafterr' is not one of", id="deployment-name"),
        pytest.param(lambda c: c["applications"][0]["deployments"][0].update(num_replicas="many"),
                     "applications[0].deployments[0]: Value error, `num_replicas` must be an int", id="replicas"),
        pytest.param(lambda c: c["applications"][0]["deployments"][0]["autoscaling_config"].update(
                     look_back_period_s=5),
                     "applications[0].deployments[0].autoscaling_config: `look_back_period_s` (5.0) must be greater",
                     id="serve-future-error"),
        pytest.param(lambda c: c["applications"][0]["args"]["verify_pool"].update(num_gpus=-1),
                     "applications[0].args.verify_pool.num_gpus: Input should be greater than or equal to 0",
                     id="app-args"),
        pytest.param(lambda c: c["applications"][0]["args"].setdefault("scheduler", {}).update(draft_cost="fast"),
                     "applications[0].args.scheduler.draft_cost: Input should be 'none' or 'measured'",
                     id="draft-cost"),
    ],
)
def test_broken_serve_config_fails_with_the_offending_path(mutate, expected: str) -> None:
    config = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    mutate(config)
    errors = validate.serve_config_errors(config)
    assert any(error.startswith(expected) for error in errors), errors


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_load_for_dspark_serve_and_for_serve_deploy(path: Path) -> None:
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app as serve_build_app

    from cluster.app import SHUTDOWN_MARGIN_S, assemble_app, build_app

    args, overrides, http = load_serve_config(path)  # what `dspark serve --config` does
    config = AppConfig.from_args(args)
    colocated = config.placement == "colocated"
    pools = [("Engine", config.verify_pool)] if colocated else [("Verifier", config.verify_pool),
                                                                 ("Drafter", config.draft_pool)]
    assert set(overrides) == {"Scheduler", "Ingress", *(name for name, _ in pools)}
    assert http["port"] == 8000
    # `serve deploy` / KubeRay: Serve calls the import path's builder with `args` (and insists on one parameter).
    call_user_app_builder_with_args_if_necessary(build_app, args)
    built = {d.name: d for d in serve_build_app(assemble_app(args, overrides), name="dspark").deployments}
    assert set(built) == set(overrides)
    for name, pool in pools:
        deployment_config = built[name]._deployment_config
        autoscaling = deployment_config.autoscaling_config
        assert autoscaling.policy.policy_function == POLICY_PATH
        assert 1 <= autoscaling.min_replicas < autoscaling.max_replicas
        assert autoscaling.get_target_ongoing_requests() < config.engine.max_requests
        assert built[name].ray_actor_options["resources"] == {pool.resource: pool.resource_per_replica}
        assert deployment_config.graceful_shutdown_timeout_s == config.scheduler.drain_timeout_s + SHUTDOWN_MARGIN_S


def test_gpu_config_runs_on_gpus_with_secrets_from_the_environment() -> None:
    args, _, _ = load_serve_config(DEPLOY / "serve_config.gpu.yaml")
    config = AppConfig.from_args(args)
    assert (config.models.device, config.models.dtype) == ("cuda", "bfloat16")
    assert config.draft_pool.num_gpus == config.verify_pool.num_gpus == 1
    assert config.scheduler.draft_cost == "measured"  # the drafter's gRPC round trip is charged, learned online
    assert config.network.grpc_token is None and config.network.api_key is None
    assert config.network.grpc_token_env and config.network.api_key_env
    assert all(str(p).startswith("/models/") for p in (config.models.target, config.models.draft))


def test_rayservice_embeds_the_gpu_serve_config(rayservice: dict) -> None:
    gpu = (DEPLOY / "serve_config.gpu.yaml").read_text()
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == yaml.safe_load(gpu)
    manifest = (DEPLOY / "rayservice.yaml").read_text()
    assert render.render(manifest, gpu) == manifest, "run: python deploy/render.py"
    assert render.main(["--check"]) == 0


def test_render_replaces_only_the_block() -> None:
    manifest = "a: 1\nspec:\n  serveConfigV2: |\n    old: 1\n\n    older: 2\n  next: 3\n"
    assert render.render(manifest, "new: 1\n\nnewer: 2\n") == (
        "a: 1\nspec:\n  serveConfigV2: |\n    new: 1\n\n    newer: 2\n  next: 3\n"
    )
    with pytest.raises(ValueError, match="serveConfigV2"):
        render.render("spec: {}\n", "x: 1\n")


def test_rayservice_pools_and_autoscaling(rayservice: dict) -> None:
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"drafter-gpu", "verifier-gpu"}
    assert groups["drafter-gpu"]["resources"] == {"draft_pool": "1"}
    assert groups["verifier-gpu"]["resources"] == {"verify_pool": "1"}
    for group in [*groups.values(), cluster["headGroupSpec"]]:
        resources = _container(group)["resources"]
        assert resources["requests"] and resources["limits"]
    head_limits = _container(cluster["headGroupSpec"])["resources"]["limits"]
    assert "nvidia.com/gpu" not in head_limits


def test_dockerfile_matches_the_manifest_and_the_package(rayservice: dict) -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = [line.split()[0] for line in text.splitlines() if line and not line[0].isspace()
                    and not line.startswith("#")]
    known = {"ARG", "FROM", "ENV", "USER", "WORKDIR", "COPY", "RUN", "EXPOSE"}
    assert set(instructions) <= known, set(instructions) - known
    # KubeRay supplies the command (`ray start ...`): the image must not impose one.
    assert "ENTRYPOINT" not in instructions and "CMD" not in instructions
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)$", text, re.M)
    assert ray_version and ray_version.group(1) == rayservice["spec"]["rayClusterConfig"]["rayVersion"]
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-py311-\$\{CUDA_TAG\}$", text, re.M)
    assert re.search(r"^USER ray$", text, re.M)
    # Every package setuptools installs is copied in, and the ignore file keeps it (and models stay out).
    include = re.search(r"find = \{ include = \[([^\]]*)\]", (ROOT / "pyproject.toml").read_text())
    assert include, "pyproject.toml: [tool.setuptools] packages find include list not found"
    packages = re.findall(r'"(\w+)\*"', include.group(1))
    assert "cluster" in packages
    copied = re.findall(r"^COPY --chown=ray:users (\S+) /tmp/dspark-serve/", text, re.M)
    assert set(packages) <= set(copied) and {"pyproject.toml"} <= set(re.findall(r"COPY \S+ (\S+) ", text))
    ignored = [line for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
               if line and not line.startswith("#")]
    for needed in [*packages, "pyproject.toml", "README.md"]:
        assert not any(fnmatch.fnmatch(needed, pattern) for pattern in ignored), needed
    assert "models" in ignored
