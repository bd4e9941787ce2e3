"""Test harness for the HTTP layer: the demo target with a small random drafter, served by a real uvicorn server
on a free loopback port in a background thread."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from model_factory import PairSpec, random_draft
from transformers import AutoTokenizer

from cluster.backend import LocalBackend
from cluster.config import AppConfig
from cluster.loading import build_local_backend
from cluster.serve_local import DEFAULT_TARGET
from draft_service.checkpoint import save_draft_model

DEMO_TARGET = DEFAULT_TARGET
MODEL = "dspark-test"


def write_demo_drafter(root: Path) -> Path:
    """A 1-layer random DSpark drafter (confidence head, Markov head) for the demo target: drafts are mostly
    rejected, which is what exactness tests want to exercise (rollback after every round)."""
    spec = PairSpec(vocab=4096, block_size=4, draft_layers=1, target_layer_ids=(1, 4, 6), markov_rank=8, seed=7)
    return save_draft_model(random_draft(DEMO_TARGET, spec), root / "draft")


def demo_backend(draft_dir: Path | None, policy: str = "dspark", max_requests: int = 4, max_seq_len: int = 256):
    config = AppConfig.from_args({
        "model_name": MODEL,
        "models": {"target": str(DEMO_TARGET), "draft": None if draft_dir is None else str(draft_dir)},
        "engine": {"max_requests": max_requests, "max_seq_len": max_seq_len},
        "scheduler": {"policy": policy},
    })
    return build_local_backend(config, tokenizer=AutoTokenizer.from_pretrained(DEMO_TARGET))


def demo_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TARGET)


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` under uvicorn on 127.0.0.1:<free port>; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            threading.Event().wait(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def free_slots(backend: LocalBackend) -> tuple[int, int, bool]:
    """(free verifier slots, free drafter slots, engine has unfinished requests), read on the loop thread."""

    def read(engine) -> tuple[int, int, bool]:
        draft = engine.draft.num_free_slots if engine.draft is not None else -1
        return engine.verify.num_free_slots, draft, engine.has_unfinished()

    return backend.call(read).result(timeout=30)
