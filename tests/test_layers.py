"""Every module of the product packages has a place in the import contracts of pyproject.toml.

`lint-imports` constrains only the modules a contract names, so a new module left out of every layer would be
free to import anything; this test fails until it joins a layer (or the offline tooling) there.
"""

from __future__ import annotations

import pathlib

import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _contracts() -> list[dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["importlinter"]["contracts"]


def _modules(packages: list[str]) -> list[str]:
    names = []
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join(parts))
    return sorted(names)


def _covered(module: str, placed: set[str]) -> bool:
    parts = module.split(".")
    return any(".".join(parts[:n]) in placed for n in range(1, len(parts) + 1))


def test_every_module_is_in_a_layer_or_is_offline_tooling() -> None:
    contracts = _contracts()
    layers = next(c for c in contracts if c["type"] == "layers")
    placed = {name.strip() for layer in layers["layers"] for name in layer.replace("|", ":").split(":")}
    offline = next(c for c in contracts if c["name"].startswith("offline tooling"))
    placed |= set(offline["forbidden_modules"])
    roots = set(layers.get("containers", [])) | {"cluster", "draft_service", "verify_service", "scheduler"}
    unplaced = [m for m in _modules(["kernels", "verify_service", "draft_service", "scheduler", "cluster"])
                if m not in roots and not _covered(m, placed)]
    assert unplaced == [], f"add these modules to a layer of [tool.importlinter] in pyproject.toml: {unplaced}"


def test_contracts_name_only_modules_that_exist() -> None:
    existing = set(_modules(["kernels", "verify_service", "draft_service", "scheduler", "cluster"]))
    layers = next(c for c in _contracts() if c["type"] == "layers")
    named = {name.strip() for layer in layers["layers"] for name in layer.replace("|", ":").split(":")}
    assert named - existing == set()
