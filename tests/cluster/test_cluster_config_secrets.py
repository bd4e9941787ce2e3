"""Secrets by environment-variable name: the config holds the name, each replica reads the value at start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import AppConfig


def test_secrets_resolve_from_the_named_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_DSPARK_TOKEN", "t0ken")
    monkeypatch.setenv("TEST_DSPARK_KEY", "k3y")
    config = AppConfig.from_args({"network": {"grpc_token_env": "TEST_DSPARK_TOKEN", "api_key_env": "TEST_DSPARK_KEY"}})
    assert config.network.grpc_token is None  # the stored / forwarded config never holds the value
    assert "t0ken" not in str(config.model_dump())
    resolved = config.resolve_secrets()
    assert (resolved.network.grpc_token, resolved.network.api_key) == ("t0ken", "k3y")
    assert resolved.models == config.models and resolved.network.grpc_timeout_s == config.network.grpc_timeout_s


def test_inline_secrets_and_no_secrets_are_left_alone() -> None:
    assert AppConfig.from_args({}).resolve_secrets().network.grpc_token is None
    inline = AppConfig.from_args({"network": {"grpc_token": "x"}})
    assert inline.resolve_secrets() is inline


def test_unset_variable_is_an_error_not_a_silent_open_door(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_DSPARK_MISSING", raising=False)
    config = AppConfig.from_args({"network": {"api_key_env": "TEST_DSPARK_MISSING"}})
    with pytest.raises(ValueError, match=r"network\.api_key_env: environment variable TEST_DSPARK_MISSING is not set"):
        config.resolve_secrets()


@pytest.mark.parametrize(
    ("network", "message"),
    [
        ({"grpc_token": "a", "grpc_token_env": "B"}, "set grpc_token or grpc_token_env, not both"),
        ({"api_key_env": "not-a-name"}, r"network\.api_key_env"),
    ],
)
def test_bad_secret_settings_are_rejected(network: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        AppConfig.from_args({"network": network})
