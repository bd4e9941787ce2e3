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


def test_inline_secrets_and_an_explicitly_open_data_plane_are_left_alone() -> None:
    open_ = AppConfig.from_args({"network": {"grpc_insecure": True}})
    assert open_.resolve_secrets() is open_ and open_.network.grpc_token is None
    inline = AppConfig.from_args({"network": {"grpc_token": "x"}})
    assert inline.resolve_secrets() is inline


def test_a_data_plane_without_a_token_is_refused_unless_explicitly_open() -> None:
    """Secure by default: neither a replica nor the application starts with an unauthenticated data plane."""
    from cluster.app import assemble_app

    config = AppConfig.from_args({})
    with pytest.raises(ValueError, match="the gRPC data plane needs a token"):
        config.resolve_secrets()
    with pytest.raises(ValueError, match="the gRPC data plane needs a token"):
        assemble_app({})
    assemble_app({"network": {"grpc_insecure": True}})  # explicitly open: builds


def test_unset_variable_is_an_error_not_a_silent_open_door(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_DSPARK_MISSING", raising=False)
    config = AppConfig.from_args({"network": {"api_key_env": "TEST_DSPARK_MISSING", "grpc_token": "t"}})
    with pytest.raises(ValueError, match=r"network\.api_key_env: environment variable TEST_DSPARK_MISSING is not set"):
        config.resolve_secrets()


@pytest.mark.parametrize(
    ("network", "message"),
    [
        ({"grpc_token": "a", "grpc_token_env": "B"}, "set grpc_token or grpc_token_env, not both"),
        ({"api_key_env": "not-a-name"}, r"network\.api_key_env"),
        ({"grpc_insecure": True, "grpc_token": "a"}, "set it or a token, not both"),
    ],
)
def test_bad_secret_settings_are_rejected(network: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        AppConfig.from_args({"network": network})
