"""``dspark serve``'s direct ingress: the settings it gives Ray Serve and when it applies (the server itself is
tested end to end in test_serve_cmd.py, where the ingress replica answers on the advertised port)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from cluster.serve_cmd import direct_ingress_environment, free_port, single_ingress

ROOT = Path(__file__).resolve().parents[2]


def test_the_advertised_port_is_the_only_direct_ingress_port_and_comes_back_at_once() -> None:
    env = direct_ingress_environment(8123)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # Serve's range ends before its maximum: exactly the one port
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == (
        "8123", "8124")
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0" and env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"


def test_direct_ingress_needs_one_ingress_replica() -> None:
    assert single_ingress({}) and single_ingress({"Ingress": {"num_replicas": 1}, "Scheduler": {"num_replicas": 2}})
    assert not single_ingress({"Ingress": {"num_replicas": 2}})
    assert not single_ingress({"Ingress": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}})


def test_asking_direct_ingress_for_several_ingress_replicas_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": [{
        "name": "dspark", "route_prefix": "/", "import_path": "cluster.app:build_app", "args": {},
        "deployments": [{"name": "Ingress", "num_replicas": 2}],
    }]}))
    command = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config), "--direct-ingress",
               "--port", str(free_port("127.0.0.1"))]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--direct-ingress needs an embedded cluster and one Ingress replica" in done.stderr
    assert "Traceback" not in done.stderr
