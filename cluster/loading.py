"""Builds engines from an :class:`AppConfig`: the one place that turns folders on disk into running objects.

Used by every way of running (in-process, standalone gRPC servers, Ray Serve replicas), so a deployment behaves the
same whichever way it is started.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cluster.cache_files import fingerprint_digest
from cluster.compile_cache import use_compile_cache
from cluster.config import AppConfig
from cluster.sps_cache import EngineShape, SPSCache, sps_fingerprint
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.warmup import warm_up_draft
from kernels.compile_watch import WATCH, CompileWatch, watch_compiles
from kernels.graphs import resolve_graph_mode
from scheduler.policy import uses_sps
from scheduler.profiling import PROFILER_VERSION, profile_graph_sps_by_requests, profile_target_sps
from scheduler.sps import SPSSource, load_sps_file
from scheduler.stopping import tokenizer_decode
from scheduler.sts import STSCalibration
from verify_service.engine import VerifyEngine
from verify_service.target import TargetModel
from verify_service.warmup import warm_up_verify

if TYPE_CHECKING:
    from cluster.backend import LocalBackend
    from draft_service.rpc_service import DrafterService
    from scheduler.engine import SpeculativeEngine
    from verify_service.rpc_service import VerifierService

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def draft_layer_ids(config: AppConfig) -> tuple[int, ...]:
    """The target layers whose hidden states the drafter consumes (none when serving without a drafter)."""
    if config.models.draft is None or config.scheduler.policy == "autoregressive":
        return ()
    from draft_service.config import DraftConfig

    return tuple(DraftConfig.from_json(Path(config.models.draft) / "config.json").target_layer_ids)


def compile_watch(config: AppConfig) -> CompileWatch:
    """The process's Triton compile watch (:func:`kernels.compile_watch.watch_compiles`) where the engines run
    Triton kernels, i.e. on CUDA; elsewhere the watch unhooked: no Triton kernel launches on a CPU, and importing
    Triton only to hook it cost a CPU replica's every start 0.1 s."""
    if torch.device(config.models.device).type != "cuda":
        return WATCH
    return watch_compiles()


def graph_mode(config: AppConfig) -> str:
    """The engines' step mode: ``engine.graphs``, with ``auto`` = capture on CUDA, off elsewhere."""
    return resolve_graph_mode(config.engine.graphs, config.models.device)


def drafter_block_size(config: AppConfig) -> int:
    """The drafter's block size gamma (1 without a drafter: verify items are then the anchor alone)."""
    if config.models.draft is None:
        return 1
    from draft_service.config import DraftConfig

    return DraftConfig.from_json(Path(config.models.draft) / "config.json").block_size


def build_verify_engine(config: AppConfig) -> VerifyEngine:
    use_compile_cache(config.cache_path)  # before the warm-up compiles the kernels
    target = TargetModel.from_pretrained(
        config.models.target,
        feature_layer_ids=draft_layer_ids(config),
        dtype=_DTYPES[config.models.dtype],
        device=config.models.device,
    )
    graphs = graph_mode(config)
    if graphs == "off":
        return VerifyEngine(target, config.engine.max_requests, config.engine.max_seq_len)
    return VerifyEngine(
        target,
        config.engine.max_requests,
        config.engine.max_seq_len,
        graphs=graphs,
        max_drafts=drafter_block_size(config),
        draft_top_k=config.engine.draft_top_k,
        graph_prefill_rows=config.engine.graph_prefill_rows,
    )


def verifier_projects(config: AppConfig) -> bool:
    """Whether this deployment's verifiers apply the drafter's context projection (and its drafters get projected
    rows): configured so, and there is a drafter to read the projection from."""
    return config.engine.context_projection == "verifier" and bool(draft_layer_ids(config))


def uses_drafter(config: AppConfig) -> bool:
    """Whether this deployment's policy drafts (``autoregressive`` and ``fixed-0`` do not)."""
    from scheduler.policy import make_policy

    policy = config.scheduler.policy
    return uses_sps(policy) or make_policy(policy, None, 1).uses_drafter


def build_draft_engine(config: AppConfig, *, projected: bool | None = None) -> DraftEngine:
    """The drafter's engine. ``projected``: whether it receives context rows the verifier already projected
    (default: :func:`verifier_projects`; an in-process round driver appends the target's raw features)."""
    if config.models.draft is None or not Path(config.models.draft).is_dir():
        if config.models.draft is not None:
            raise ValueError(
                f"drafter folder {config.models.draft} not found: pass --draft DIR (models.draft), or serve "
                "without speculation with --policy autoregressive"
            )
        raise ValueError("this deployment has no drafter (models.draft is null)")
    use_compile_cache(config.cache_path)  # before the warm-up compiles the kernels
    model = load_draft_model(
        config.models.draft,
        target_dir=config.models.target,
        dtype=_DTYPES[config.models.dtype],
        device=config.models.device,
    )
    sts_path = Path(config.models.sts) if config.models.sts else Path(config.models.draft) / "sts.json"
    calibration = STSCalibration.load(sts_path) if sts_path.exists() else None
    if calibration is None:
        logger.warning("no STS calibration at %s: confidences are raw sigmoid outputs", sts_path)
    return DraftEngine(
        model,
        config.engine.max_requests,
        config.engine.max_seq_len,
        draft_top_k=config.engine.draft_top_k,
        calibration=calibration,
        projected_context=verifier_projects(config) if projected is None else projected,
        graphs=graph_mode(config),
    )


def profiled_request_counts(max_requests: int) -> list[int]:
    """The request counts a bucketed verifier profiles SPS tables at: powers of two below ``max_requests``, and
    ``max_requests`` itself (a round of R requests is priced with the table of the smallest count >= R)."""
    return sorted({*(1 << i for i in range(max(max_requests, 1).bit_length()) if 1 << i < max_requests), max_requests})


@dataclass(frozen=True)
class LoadedSPS:
    """The SPS table(s) a verifier prices rounds with, and where they came from: ``origin`` holds ``source``
    (``file``: ``models.sps``; ``cache``: the SPS cache; ``profiled``: measured at this start, then cached),
    ``path`` and, unless from a file, the cache ``fingerprint`` digest."""

    sps: SPSSource
    origin: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        """The table's JSON (either format) plus an ``origin`` entry, which the SPS loaders ignore: what a
        verifier registers with and ``/v1/models`` shows."""
        return {**self.sps.to_dict(), "origin": self.origin}


def engine_shape(config: AppConfig, block_size: int) -> EngineShape:
    """The verify engine shape ``build_verify_engine`` gives ``config`` (what its SPS table depends on)."""
    return EngineShape(
        block_size=block_size,
        max_requests=config.engine.max_requests,
        graphs=graph_mode(config),
        draft_top_k=config.engine.draft_top_k,
        graph_prefill_rows=config.engine.graph_prefill_rows,
    )


def _profile_sps(config: AppConfig, verify: VerifyEngine, block_size: int) -> SPSSource:
    """Profile now: with bucketed steps (graphs) tables by request count of the step the engine runs, else a
    token table of eager target passes."""
    if verify.graphs is not None:
        counts = profiled_request_counts(config.engine.max_requests)
        logger.info("profiling SPS(B) of the graph step at %s requests", counts)
        tables, _ = profile_graph_sps_by_requests(verify, chunk=block_size + 1, request_counts=counts)
        return tables
    logger.info("profiling SPS(B) of the target")
    max_tokens = config.engine.max_requests * (block_size + 1)
    return profile_target_sps(verify.target, chunk=block_size + 1, max_batch_tokens=max_tokens, progress=False)


def load_or_profile_sps(
    config: AppConfig, verify: VerifyEngine, block_size: int, *, refresh: bool = False
) -> LoadedSPS:
    """The SPS table(s) for this verifier, the one implementation every server uses (Ray verifier replicas,
    ``dspark verify-server``, ``dspark serve --no-ray``, ``dspark profile``): the configured file
    (``models.sps``) when set, else the SPS cache's table for this engine's fingerprint, else profiled now and
    stored in the cache. ``refresh`` profiles (and overwrites the cache entry) even when a table is available.
    The table used is logged once, with where it came from."""
    if config.models.sps and not refresh:
        logger.info("SPS table from %s (models.sps)", config.models.sps)
        return LoadedSPS(load_sps_file(config.models.sps), {"source": "file", "path": str(config.models.sps)})
    fingerprint = sps_fingerprint(
        config.models.target,
        draft_layer_ids(config),
        config.models.dtype,
        verify.target.device,
        engine_shape(config, block_size),
        PROFILER_VERSION,
    )
    cache = SPSCache(config.cache_path / "sps")
    name = Path(config.models.target).name
    path = cache.path_for(name, fingerprint)
    digest = fingerprint_digest(fingerprint)
    cached = None if refresh else cache.lookup(name, fingerprint)
    if cached is not None:
        logger.info("SPS table from the cache: %s", path)
        return LoadedSPS(cached, {"source": "cache", "path": str(path), "fingerprint": digest})
    started = time.perf_counter()
    sps = _profile_sps(config, verify, block_size)
    try:
        cache.store(name, fingerprint, sps)
    except OSError as error:  # a read-only or full cache folder costs the next start a profile, nothing else
        logger.warning("SPS table profiled but not cached (%s): the next start profiles again", error)
    logger.info("SPS table profiled in %.1f s, cached at %s", time.perf_counter() - started, path)
    return LoadedSPS(sps, {"source": "profiled", "path": str(path), "fingerprint": digest})


def serving_sps(config: AppConfig, verify: VerifyEngine, block_size: int) -> LoadedSPS | None:
    """What a server prices rounds with: :func:`load_or_profile_sps` for the policies that schedule with SPS
    tables (``dspark``, ``dspark-async``); None for the others, which need none (nothing is profiled)."""
    if not uses_sps(config.scheduler.policy):
        return None
    return load_or_profile_sps(config, verify, block_size)


def build_round_engine(
    config: AppConfig, *, decode: Callable[[Sequence[int]], str] | None = None
) -> tuple[SpeculativeEngine, LoadedSPS | None]:
    """Both engines and the round driver in one process: the in-process placement of the round pipeline (what
    ``dspark serve --no-ray`` and a ``colocated`` Serve replica run), built from the same :class:`AppConfig`
    as the disaggregated replicas (:func:`build_verifier_service`, :func:`build_drafter_service`).

    The engines are warmed up one by one, the SPS table is loaded or profiled (:func:`serving_sps`), then, with
    captured graphs, the whole pipeline is warmed up at every request count its buckets cover
    (:func:`scheduler.warmup.warm_up_rounds`) on a throw-away driver, and the serving driver is built fresh
    over the same engines. With captured graphs the driver overlaps the round's phases on the device
    (``engine.draft_ahead``; ``engine.chain_rounds``: verify queued behind the draft step and the next draft
    step behind the verify step); those need both engines on one device, which is why only this placement has
    them. ``decode`` turns token ids into text for stop strings and streamed text (None: no text).
    """
    from scheduler.engine import SpeculativeEngine
    from scheduler.policy import make_policy
    from scheduler.warmup import warm_up_rounds

    drafting = uses_drafter(config)
    if drafting and (config.models.draft is None or not Path(config.models.draft).is_dir()):
        raise ValueError(
            f"drafter folder {config.models.draft} not found: pass --draft DIR (models.draft), or serve without "
            "speculation with --policy autoregressive"
        )
    block_size = drafter_block_size(config) if drafting else 1
    watch = compile_watch(config)
    verify = build_verify_engine(config)
    warm_up_verify(verify, block_size)
    draft = None
    if uses_drafter(config):
        draft = build_draft_engine(config, projected=False)
        warm_up_draft(draft, projected=False)
    loaded = serving_sps(config, verify, block_size)
    overlap = graph_mode(config) == "capture"

    def driver() -> SpeculativeEngine:
        policy = make_policy(config.scheduler.policy, None if loaded is None else loaded.sps, block_size,
                             config.scheduler.draft_cost, config.scheduler.chain_tolerance)
        return SpeculativeEngine(
            verify,
            draft,
            policy,
            decode=decode,
            eos_token_ids=verify.target.eos_token_ids,
            draft_ahead=overlap and config.engine.draft_ahead,
            chain_verify=overlap and config.engine.chain_rounds,
            chain_draft=overlap and config.engine.chain_rounds,
            service_levels=config.scheduler.service_levels.levels(),
        )

    if overlap:
        scratch = driver()
        warm_up_rounds(scratch, profiled_request_counts(config.engine.max_requests))
        scratch.close()
    watch.arm()
    return driver(), loaded


def build_local_backend(config: AppConfig, *, tokenizer: Any = None) -> LocalBackend:
    """:func:`build_round_engine` behind a :class:`LocalBackend` (its loop thread runs from here), reporting
    the SPS table it prices rounds with as ``/v1/models`` metadata. ``tokenizer``: used for detokenising and
    stop strings on the loop thread; pass one no other thread uses (the HTTP app tokenises on its own)."""
    from cluster.backend import LocalBackend

    decode = tokenizer_decode(tokenizer) if tokenizer is not None else None
    engine, loaded = build_round_engine(config, decode=decode)
    info = {"sps": {} if loaded is None else {"local": loaded.to_dict()}}
    return LocalBackend(engine, config.model_name, info=info)


def build_verifier_service(config: AppConfig) -> VerifierService:
    """The verifier replica's service: target engine (warmed up), its SPS table (:func:`serving_sps`), gRPC
    adapter.

    The same for a Ray Serve replica and a standalone ``dspark verify-server``; the table travels in the
    service's ``Info`` so a scheduler learns it with the replica's address.
    """
    from draft_service.projection import load_context_projection
    from verify_service.rpc_service import VerifierService

    watch = compile_watch(config)
    engine = build_verify_engine(config)
    warm_up_verify(engine, drafter_block_size(config))
    loaded = serving_sps(config, engine, drafter_block_size(config))
    watch.arm()
    sps = loaded.to_dict() if loaded is not None else None
    projection = None
    if verifier_projects(config):
        assert config.models.draft is not None
        projection = load_context_projection(
            config.models.draft, dtype=_DTYPES[config.models.dtype], device=config.models.device
        )
    feature_dtype = None if config.engine.feature_dtype == "model" else _DTYPES[config.engine.feature_dtype]
    return VerifierService(
        engine,
        token=config.network.grpc_token,
        timeout_s=config.network.grpc_timeout_s,
        sps=sps,
        projection=projection,
        feature_dtype=feature_dtype,
        draft_ahead=config.engine.draft_ahead,
        feature_transport=config.engine.feature_transport,
        link_timeout_s=config.engine.feature_link_timeout_s,
    )


def build_drafter_service(config: AppConfig, grpc_host: str) -> DrafterService:
    """The drafter replica's service (its engine warmed up); with ``feature_transport: collective`` it hosts
    its feature-link store on ``grpc_host`` (the address verifiers already reach it at)."""
    from draft_service.rpc_service import DrafterService

    collective = config.engine.feature_transport == "collective"
    watch = compile_watch(config)
    engine = build_draft_engine(config)
    warm_up_draft(engine, projected=verifier_projects(config))
    watch.arm()
    return DrafterService(
        engine,
        link_host=grpc_host if collective else None,
        link_timeout_s=config.engine.feature_link_timeout_s,
    )
