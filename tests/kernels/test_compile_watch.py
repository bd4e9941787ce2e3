"""The compile watch (kernels.compile_watch): Triton's JIT-cache hooks installed in the process, and a
specialisation built after warm-up logged once with its kernel and counted, one built before only counted.
Triton calls the hooks with keyword arguments only (``triton.knobs.JITHook``); the tests call them the same way:
on CPU the interpreter runs kernels without the JIT cache, so the hooks are driven directly here."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kernels.compile_watch import WATCH, CompileWatch, watch_compiles


def _build(watch: CompileWatch, key: str) -> None:
    hook = {
        "key": key,
        "repr": "kernel[num_warps=4](n: i32D)",
        "fn": SimpleNamespace(name="kernel"),
        "compile": {"key": key, "constants": {"BLOCK": 64, "TAG": key}, "signature": {"n": "i32"}},
    }
    watch.on_cache_miss(**hook)
    watch.on_built(**hook)


def test_only_specialisations_built_after_arming_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    watch = CompileWatch()
    with caplog.at_level(logging.WARNING, logger="kernels.compile_watch"):
        _build(watch, "warm-up")
        assert caplog.records == []
        watch.arm()
        _build(watch, "gap")
    assert (watch.before_armed, watch.after_armed) == (1, 1)
    assert watch.after_armed_s >= 0.0
    [record] = caplog.records
    message = record.getMessage()
    assert "kernel" in message and "'TAG': 'gap'" in message and "'n': 'i32'" in message


def test_watch_installs_triton_hooks_once() -> None:
    from triton import knobs

    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    try:
        assert watch_compiles() is WATCH and watch_compiles() is WATCH
        assert knobs.runtime.jit_cache_hook == WATCH.on_cache_miss
        assert knobs.runtime.jit_post_compile_hook == WATCH.on_built
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before
