"""Offline checks of the deployment files: KubeRay manifests against the CRD schemas, Serve configs against Serve.

What a cluster would reject, or silently get wrong, found before ``kubectl apply`` / ``serve deploy``:

* a KubeRay object (RayService, RayCluster) against the OpenAPI schema of its CustomResourceDefinition, with
  unknown fields rejected (``additionalProperties: false`` wherever the schema lists ``properties``, as KubeRay's
  own tooling does; the API server would silently prune them);
* a Serve config (a plain file, or a RayService's ``serveConfigV2``) against Ray Serve's schema, strictly (Serve
  ignores unknown keys at most levels), every ``autoscaling_config`` against Serve's ``AutoscalingConfig`` (which
  imports the policy), and the application's ``args`` against :class:`cluster.config.AppConfig`;
* a RayService's consistency with its embedded config: each pool's custom resource advertised by exactly one
  worker group with enough GPUs and pods for the deployment's ``max_replicas``, the model folders on a mounted
  PersistentVolumeClaim and the secret environment variables defined in every pod that needs them.

Every message starts with the path of the offending field (``spec.rayClusterConfig.workerGroupSpecs[0]...``).

    python deploy/validate.py --crds ../shared/data/kuberay            # every YAML file under deploy/
    python deploy/validate.py --crds DIR deploy/rayservice.yaml
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
IMPORT_PATH = "cluster.app:build_app"
POOL_DEPLOYMENTS = ("Drafter", "Verifier", "Engine")
#: The deployments of each placement (``args.placement``).
DEPLOYMENTS = {"disaggregated": ("Scheduler", "Verifier", "Drafter", "Ingress"),
               "colocated": ("Scheduler", "Engine", "Ingress")}
_ObjectMetaKeys = {"name", "namespace", "labels", "annotations"}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are ~1 MB: the C loader is much faster


def format_path(parts: Iterable[Any]) -> str:
    """``("spec", "workerGroupSpecs", 0, "groupName")`` -> ``spec.workerGroupSpecs[0].groupName``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


# ------------------------------------------------------------------------------------------- CRD schemas
def strict_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of an OpenAPI v3 (structural) schema that rejects fields it does not list."""
    out = copy.deepcopy(dict(schema))

    def visit(node: Any) -> None:
        if not isinstance(node, dict):
            return
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for key in ("properties", "patternProperties"):
            for child in node.get(key, {}).values():
                visit(child)
        for key in ("items", "additionalProperties", "not"):
            visit(node.get(key))
        for key in ("anyOf", "allOf", "oneOf"):
            for child in node.get(key, []):
                visit(child)

    visit(out)
    return out


def load_crd_schemas(crd_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """``(apiVersion, kind) -> strict schema`` for every CustomResourceDefinition in the folder."""
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(Path(crd_dir).glob("*.yaml")):
        for crd in yaml.load_all(path.read_text(), Loader=_Loader):
            if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schemas[(f"{group}/{version['name']}", kind)] = strict_schema(version["schema"]["openAPIV3Schema"])
    if not schemas:
        raise ValueError(f"no CustomResourceDefinition found in {crd_dir}")
    return schemas


def _drop_nulls(value: Any) -> Any:
    """The API server drops null fields before validating; do the same."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def crd_errors(doc: Mapping[str, Any], schemas: Mapping[tuple[str, str], dict[str, Any]]) -> list[str]:
    """Schema errors of one Kubernetes object of a kind the CRDs define."""
    from jsonschema import Draft4Validator

    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in schemas:
        known = ", ".join(f"{a} {k}" for a, k in sorted(schemas))
        return [f"<root>: no CRD schema for apiVersion {key[0]!r} kind {key[1]!r} (known: {known})"]
    errors = []
    metadata = doc.get("metadata")
    if not isinstance(metadata, dict) or not _DNS_LABEL.match(str(metadata.get("name", ""))):
        errors.append("metadata.name: required, a DNS label (lower-case letters, digits and '-')")
    elif unknown := sorted(set(metadata) - _ObjectMetaKeys):
        errors.append(f"metadata: unexpected keys {unknown} (a manifest sets {sorted(_ObjectMetaKeys)})")
    validator = Draft4Validator(schemas[key])  # OpenAPI v3.0 schemas are JSON Schema draft 4 plus extensions
    for error in sorted(validator.iter_errors(_drop_nulls(dict(doc))), key=lambda e: list(map(str, e.absolute_path))):
        errors.append(f"{format_path(error.absolute_path)}: {error.message}")
    return errors


# ---------------------------------------------------------------------------------------- Serve configs
def _schema_models() -> dict[str, Any]:
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy
    from ray.serve.schema import (
        DeploymentSchema,
        HTTPOptionsSchema,
        RayActorOptionsSchema,
        ServeApplicationSchema,
        ServeDeploySchema,
    )

    return {
        "deploy": ServeDeploySchema,
        "http_options": HTTPOptionsSchema,
        "applications": ServeApplicationSchema,
        "deployments": DeploymentSchema,
        "ray_actor_options": RayActorOptionsSchema,
        "autoscaling_config": AutoscalingConfig,
        "policy": AutoscalingPolicy,
    }


def _unknown_keys(data: Any, model: Any, path: tuple[Any, ...], models: Mapping[str, Any]) -> list[str]:
    """Keys Serve would ignore silently (most of its schema models accept extra keys), recursively."""
    if not isinstance(data, dict):
        return []
    errors = []
    allowed = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    for key, value in data.items():
        if key not in allowed:
            errors.append(f"{format_path((*path, key))}: unknown field (not in Serve's {model.__name__})")
        elif key in models and key != "deploy":
            items = value if isinstance(value, list) else [value]
            for index, item in enumerate(items):
                sub = (*path, key, index) if isinstance(value, list) else (*path, key)
                errors += _unknown_keys(item, models[key], sub, models)
    return errors


def _pydantic_errors(error: Any, prefix: tuple[Any, ...]) -> list[str]:
    return [f"{format_path((*prefix, *e['loc']))}: {e['msg']}" for e in error.errors()]


def _policy_import_errors(raw: Mapping[str, Any], prefix: tuple[Any, ...]) -> list[str]:
    """Which deployments name an autoscaling policy that cannot be imported."""
    from ray.serve.config import AutoscalingPolicy

    errors = []
    for a_index, app in enumerate(raw.get("applications") or []):
        for d_index, deployment in enumerate(app.get("deployments") or []):
            policy = (deployment.get("autoscaling_config") or {}).get("policy")
            if not isinstance(policy, dict):
                continue
            try:
                AutoscalingPolicy(**policy)
            except Exception as error:
                path = (*prefix, "applications", a_index, "deployments", d_index, "autoscaling_config", "policy")
                errors.append(f"{format_path(path)}: cannot be imported ({error})")
    return errors


def serve_config_errors(raw: Any, prefix: tuple[Any, ...] = ()) -> list[str]:
    """Errors of a Serve config (``serve deploy`` file / ``serveConfigV2``) that runs this project's app."""
    from pydantic import ValidationError

    from cluster.config import AppConfig

    models = _schema_models()
    try:
        schema = models["deploy"].model_validate(raw)  # also imports every autoscaling policy function
    except ValidationError as error:
        return _pydantic_errors(error, prefix)
    except (ImportError, AttributeError):
        return _policy_import_errors(raw, prefix)
    errors = _unknown_keys(raw, models["deploy"], prefix, models)
    apps = [(i, a) for i, a in enumerate(raw["applications"]) if a.get("import_path") == IMPORT_PATH]
    if len(apps) != 1:
        errors.append(f"{format_path((*prefix, 'applications'))}: exactly one application must import {IMPORT_PATH}")
        return errors
    index, app = apps[0]
    app_path = (*prefix, "applications", index)
    try:
        config = AppConfig.from_args(app.get("args"))
    except ValidationError as error:
        errors += _pydantic_errors(error, (*app_path, "args"))
        config = None
    names = DEPLOYMENTS[config.placement] if config is not None else tuple(dict.fromkeys(sum(DEPLOYMENTS.values(), ())))
    for d_index, deployment in enumerate(schema.applications[index].deployments or []):
        d_path = (*app_path, "deployments", d_index)
        if deployment.name not in names:
            errors.append(f"{format_path((*d_path, 'name'))}: {deployment.name!r} is not one of {list(names)}")
        autoscaling = app["deployments"][d_index].get("autoscaling_config")
        if autoscaling is None:
            continue
        try:
            with warnings.catch_warnings(record=True) as caught:  # "will raise in a future release" etc.
                warnings.simplefilter("always")
                parsed = models["autoscaling_config"].model_validate(autoscaling)  # imports the policy function
            errors += [
                f"{format_path((*d_path, 'autoscaling_config'))}: {w.message}"
                for w in caught
                if issubclass(w.category, (FutureWarning, DeprecationWarning)) and "ray/serve" in w.filename
            ]
        except (ValidationError, ImportError, AttributeError) as error:
            if isinstance(error, ValidationError):
                errors += _pydantic_errors(error, (*d_path, "autoscaling_config"))
            else:
                errors.append(f"{format_path((*d_path, 'autoscaling_config', 'policy'))}: {error}")
            continue
        if deployment.name in POOL_DEPLOYMENTS and config is not None:
            target = parsed.get_target_ongoing_requests()
            if target >= config.engine.max_requests:
                errors.append(
                    f"{format_path((*d_path, 'autoscaling_config', 'target_ongoing_requests'))}: {target} must be "
                    f"below engine.max_requests ({config.engine.max_requests}): a full replica holds exactly that "
                    "many requests, so the pool would never scale out"
                )
    return errors


# ------------------------------------------------------------------------------------ RayService checks
def _group_resources(group: Mapping[str, Any]) -> dict[str, float]:
    """Custom resources a group advertises: the v1 ``resources`` field, else ``rayStartParams.resources``."""
    if group.get("resources"):
        return {k: float(v) for k, v in group["resources"].items()}
    text = group.get("rayStartParams", {}).get("resources")
    if not text:
        return {}
    return {k: float(v) for k, v in json.loads(text.strip("'\"").replace("\\", "")).items()}


def _containers(group: Mapping[str, Any]) -> list[dict[str, Any]]:
    return group.get("template", {}).get("spec", {}).get("containers", [])


def _gpus(group: Mapping[str, Any]) -> float:
    containers = _containers(group)
    limits = containers[0].get("resources", {}).get("limits", {}) if containers else {}
    return float(limits.get("nvidia.com/gpu", 0))


def _pvc_mounts(group: Mapping[str, Any]) -> list[str]:
    """Mount paths of the Ray container that come from a PersistentVolumeClaim."""
    spec = group.get("template", {}).get("spec", {})
    claims = {v["name"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
    containers = _containers(group)
    mounts = containers[0].get("volumeMounts", []) if containers else []
    return [m["mountPath"].rstrip("/") for m in mounts if m.get("name") in claims]


def _writable_pvc_mounts(group: Mapping[str, Any]) -> list[str]:
    """Mount paths of the Ray container from a PersistentVolumeClaim that the pod may write (a cache needs it)."""
    spec = group.get("template", {}).get("spec", {})
    claims = {v["name"] for v in spec.get("volumes", [])
              if "persistentVolumeClaim" in v and not v["persistentVolumeClaim"].get("readOnly")}
    containers = _containers(group)
    mounts = containers[0].get("volumeMounts", []) if containers else []
    return [m["mountPath"].rstrip("/") for m in mounts if m.get("name") in claims and not m.get("readOnly")]


def _env_value(group: Mapping[str, Any], name: str) -> str | None:
    containers = _containers(group)
    for entry in containers[0].get("env", []) if containers else []:
        if entry.get("name") == name:
            return entry.get("value")
    return None


def _cache_errors(path: tuple[Any, ...], group: Mapping[str, Any], cache_dir: str | None) -> list[str]:
    """A pool pod's start-up caches (SPS tables, Triton kernels: ``<cache_dir>/sps``, ``<cache_dir>/triton``)
    must be on a writable claim, or every new pod profiles and compiles again (issue 27's start-up time).
    ``cache_dir`` is the application's; else the pod's ``$DSPARK_CACHE_DIR`` decides, as in the replica."""
    folder = cache_dir or _env_value(group, "DSPARK_CACHE_DIR")
    where = format_path((*path, "template", "spec", "containers", 0))
    if not folder:
        return [f"{where}.env: no cache folder (args.cache_dir or DSPARK_CACHE_DIR): SPS tables and compiled "
                "kernels would be lost with every pod"]
    folder = folder.rstrip("/")
    mounts = _writable_pvc_mounts(group)
    if not any(folder == m or folder.startswith(m + "/") for m in mounts):
        return [f"{where}.volumeMounts: the cache folder {folder} is not on a writable PersistentVolumeClaim "
                f"(writable claims mounted: {mounts})"]
    return []


def _env_names(group: Mapping[str, Any]) -> set[str]:
    containers = _containers(group)
    return {e.get("name") for e in (containers[0].get("env", []) if containers else [])}


def _max_replicas(deployment: Mapping[str, Any] | None) -> int:
    if deployment is None:
        return 1
    if deployment.get("autoscaling_config"):
        return int(deployment["autoscaling_config"].get("max_replicas", 1))
    replicas = deployment.get("num_replicas", 1)
    return replicas if isinstance(replicas, int) else 1


def _readiness_probe_errors(cluster: Mapping[str, Any], serve_port: int) -> list[str]:
    """The head pod hosts the HTTP proxy: its readiness must be the application's (``python -m cluster.probe``
    on the serve port's /health), or the serve Service sends clients to it before it can serve."""
    path = ("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, "readinessProbe")
    containers = _containers(cluster.get("headGroupSpec", {}))
    probe = containers[0].get("readinessProbe") if containers else None
    command = " ".join(str(part) for part in ((probe or {}).get("exec") or {}).get("command", []))
    if "cluster.probe" not in command:
        return [f"{format_path(path)}: no readiness probe of the application (python -m cluster.probe): the pod "
                "would be sent clients before a completion can be served"]
    if f":{serve_port}/health" not in command:
        return [f"{format_path(path)}: the probe must ask the serve port's /health (:{serve_port}/health)"]
    return []


def _preload_errors(cluster: Mapping[str, Any]) -> list[str]:
    """``spare_workers`` pays only where every Ray pod's workers preload the application
    (:func:`cluster.spare_workers.preload_environment`); without it a spare is a bare worker, and Ray prestarts
    idle workers of its own."""
    from cluster.spare_workers import preload_environment

    groups = [(("spec", "rayClusterConfig", "headGroupSpec"), cluster.get("headGroupSpec", {}))]
    groups += [(("spec", "rayClusterConfig", "workerGroupSpecs", i), g)
               for i, g in enumerate(cluster.get("workerGroupSpecs", []))]
    errors = []
    for path, group in groups:
        for name, value in preload_environment().items():
            if _env_value(group, name) != value:
                errors.append(f"{format_path((*path, 'template', 'spec', 'containers', 0, 'env'))}: {name} must be "
                              f"{value!r} for args.spare_workers (the pod's workers preload the application)")
    return errors


def rayservice_errors(doc: Mapping[str, Any]) -> list[str]:
    """The embedded Serve config, and whether the cluster can actually host it (pools, GPUs, models, secrets)."""
    from pydantic import ValidationError

    from cluster.config import AppConfig

    spec = doc.get("spec", {})
    try:
        raw = yaml.safe_load(spec.get("serveConfigV2", ""))
    except yaml.YAMLError as error:
        return [f"spec.serveConfigV2: not YAML ({error})"]
    errors = serve_config_errors(raw, ("spec", "serveConfigV2"))
    if errors:
        return errors
    app = next(a for a in raw["applications"] if a.get("import_path") == IMPORT_PATH)
    try:
        config = AppConfig.from_args(app.get("args"))
    except ValidationError:  # already reported above
        return errors
    deployments = {d["name"]: d for d in app.get("deployments", [])}
    cluster = spec.get("rayClusterConfig", {})
    errors += _readiness_probe_errors(cluster, int((raw.get("http_options") or {}).get("port", 8000)))
    if config.spare_workers:
        errors += _preload_errors(cluster)
    groups = cluster.get("workerGroupSpecs", [])
    head = ("spec", "rayClusterConfig", "headGroupSpec")
    needs_models: list[tuple[tuple[Any, ...], Mapping[str, Any]]] = [(head, cluster.get("headGroupSpec", {}))]
    pools = [("Engine" if config.placement == "colocated" else "Verifier", config.verify_pool)]
    if config.scheduler.policy != "autoregressive" and config.placement == "disaggregated":
        pools.append(("Drafter", config.draft_pool))
    for name, pool in pools:
        hosts = [(i, g) for i, g in enumerate(groups) if pool.resource in _group_resources(g)]
        if len(hosts) != 1:
            errors.append(
                f"spec.rayClusterConfig.workerGroupSpecs: exactly one group must advertise {pool.resource!r} "
                f"(the {name} pool), found {len(hosts)}"
            )
            continue
        index, group = hosts[0]
        path = ("spec", "rayClusterConfig", "workerGroupSpecs", index)
        needs_models.append((path, group))
        errors += _cache_errors(path, group, config.cache_dir)
        per_pod = math.floor(_group_resources(group)[pool.resource] / pool.resource_per_replica + 1e-9)
        gpus = _gpus(group)
        if pool.num_gpus > 0:
            per_pod = min(per_pod, math.floor(gpus / pool.num_gpus + 1e-9))
        if per_pod < 1:
            errors.append(
                f"{format_path((*path, 'resources'))}: a pod cannot host one {name} replica "
                f"({pool.resource} {pool.resource_per_replica}, {pool.num_gpus} GPU; the pod has {gpus} GPU)"
            )
            continue
        wanted = _max_replicas(deployments.get(name))
        if group.get("maxReplicas", 0) * per_pod < wanted:
            errors.append(
                f"{format_path((*path, 'maxReplicas'))}: {group.get('maxReplicas', 0)} pods of {per_pod} {name} "
                f"replicas each cannot hold the deployment's max_replicas {wanted}"
            )
    model_paths = {k: v for k, v in config.models.model_dump().items() if k in {"target", "draft", "tokenizer",
                                                                                 "sts", "sps"} and v}
    secrets = [v for v in (config.network.grpc_token_env, config.network.api_key_env) if v]
    for path, group in needs_models:
        mounts = _pvc_mounts(group)
        for key, folder in model_paths.items():
            if not any(folder == m or folder.startswith(m + "/") for m in mounts):
                errors.append(
                    f"{format_path((*path, 'template', 'spec', 'containers', 0, 'volumeMounts'))}: "
                    f"models.{key} {folder} is not on a mounted PersistentVolumeClaim (mounted: {mounts})"
                )
        for variable in secrets:
            if variable not in _env_names(group):
                errors.append(
                    f"{format_path((*path, 'template', 'spec', 'containers', 0, 'env'))}: {variable} is not set "
                    "(the Serve config reads a secret from it)"
                )
    return errors


# ----------------------------------------------------------------------------------------------- files
def document_errors(doc: Any, schemas: Mapping[tuple[str, str], dict[str, Any]]) -> list[str]:
    """All errors of one YAML document: a Kubernetes object, or a Serve config."""
    if not isinstance(doc, dict):
        return ["<root>: expected a mapping"]
    if "applications" in doc and "kind" not in doc:
        return serve_config_errors(doc)
    errors = crd_errors(doc, schemas)
    if doc.get("kind") == "RayService" and not errors:
        errors += rayservice_errors(doc)
    return errors


def file_errors(path: Path, schemas: Mapping[tuple[str, str], dict[str, Any]]) -> list[str]:
    errors = []
    for number, doc in enumerate(yaml.safe_load_all(Path(path).read_text())):
        if doc is not None:
            errors += [f"{path.name}#{number} {e}" for e in document_errors(doc, schemas)]
    return errors


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crds", type=Path, required=True, help="folder of KubeRay CRD YAML files")
    parser.add_argument("files", nargs="*", type=Path, help="default: every .yaml file under deploy/")
    args = parser.parse_args(argv)
    schemas = load_crd_schemas(args.crds)
    errors = []
    for path in args.files or sorted(HERE.glob("*.yaml")):
        errors += file_errors(path, schemas)
    for error in errors:
        print(error, file=sys.stderr)
    print(f"{len(errors)} error(s)" if errors else "all valid")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))  # the checkout's own packages (cluster.config, the policy module)
    sys.exit(main())
