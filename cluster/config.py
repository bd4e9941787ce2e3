"""The serving configuration: one model of what a deployment is, read from the Serve config's ``args``.

The same YAML file describes a deployment everywhere: ``dspark serve --config FILE`` reads it, ``serve deploy FILE``
runs it on an existing Ray cluster, and the KubeRay manifest embeds it as ``serveConfigV2``. This module owns the
``args`` part (models, pools, engine limits, scheduler policy, ports, security); Ray Serve owns the rest (per
deployment ``num_replicas`` / ``autoscaling_config`` / ``ray_actor_options`` overrides).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scheduler.chain_plan import CHAIN_TOLERANCE
from scheduler.service_levels import ServiceLevels

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO_ROOT / "models" / "demo" / "target"
DEMO_DRAFT = REPO_ROOT / "models" / "demo" / "draft_dspark"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """Local model folders; nothing is ever downloaded."""

    target: str = str(DEMO_TARGET)
    draft: str | None = str(DEMO_DRAFT)
    tokenizer: str | None = None  # default: the target folder
    sts: str | None = None  # STS calibration JSON; default: <draft>/sts.json when present
    sps: str | None = None  # SPS table JSON; default: looked up in the SPS cache, profiled at startup when missing
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.target


class PoolConfig(_Strict):
    """Where a deployment's replicas go: a Ray custom resource names the pool."""

    resource: str
    resource_per_replica: float = Field(0.01, gt=0)
    num_gpus: float = Field(0.0, ge=0)
    num_cpus: float = Field(1.0, ge=0)

    def actor_options(self) -> dict[str, Any]:
        return {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "resources": {self.resource: self.resource_per_replica},
        }


class EngineConfig(_Strict):
    """Per-replica limits (KV slots, context), the drafter's sparse distribution width, and the context-feature
    data plane: ``context_projection`` says who applies the drafter's ``fc`` + ``hidden_norm`` to the target's
    hidden states: the ``verifier`` (default; it reads those two tensors from the drafter checkpoint and sends 1/m
    of the bytes, stamped with the projection's fingerprint, which the drafters check) or the ``drafter`` (raw
    features travel). ``feature_dtype``: the dtype features travel in; ``model`` (the models' dtype, exact: the
    drafter computes in it anyway) or a narrower one (``bfloat16`` for a float32 deployment halves the bytes
    again but rounds the drafter's context, so drafts may differ: output stays lossless, acceptance may move).
    ``draft_ahead``: drafters draft a request's next block as soon as its context arrives (the verifier names the
    next anchor), overlapping the scheduler's commit instead of waiting for its ``Propose``; in the in-process
    placement (``colocated``, ``--no-ray``) with captured graphs, the round driver launches the next round's draft
    step before it commits the round. ``relay_drafts`` (disaggregated placement, with ``draft_ahead`` and one
    request group): the drafters return those drafts to the verifier, and a round whose lengths the policy plans
    before its drafts exist (as for ``chain_rounds``) is one ``Step`` that verifies them there, with no ``Propose``:
    one message each way between the scheduler and the pools instead of two, with the drafting hidden behind the
    reply's trip; the other rounds send the ``Propose`` as without. ``chain_rounds``
    (in-process placement with captured graphs): rounds whose lengths are planned from earlier rounds queue the
    verify step behind the draft step and the next draft step behind the verify step on the device, with no host
    round trip between them (lossless: lengths depend on counts and earlier rounds only).
    ``feature_transport``: how the rows travel, ``grpc`` (bytes inside the ``AppendContext`` message, default) or
    ``collective`` (a torch.distributed point-to-point link per verifier/drafter pair, gloo for CPU tensors, NCCL
    for CUDA ones, with only metadata over gRPC; a drafter whose link cannot be built gets bytes over gRPC; see
    :mod:`cluster.feature_link`). ``feature_link_timeout_s`` bounds every wait on a link.
    ``graphs``: how the verify and draft steps run: ``capture`` (CUDA graphs of the bucketed steps, replayed:
    on a GPU a step is launch-bound when eager, so its replay is several times faster: docs/benchmarks/engine.md),
    ``static`` (the same bucketed steps run eagerly: the graph path's layout on CPU, for tests), ``off`` (eager,
    any batch) or ``auto`` (the default: ``capture`` on CUDA, ``off`` elsewhere). Steps that fit no bucket run
    eagerly; ``graph_prefill_rows`` is the room a bucketed verify step keeps for joining prompts' tokens. With
    graphs a verifier that profiles at start profiles SPS tables by request count (the scheduler prices each round
    at its own R), else a token table."""

    max_requests: int = Field(64, ge=1, le=4096)
    max_seq_len: int = Field(1024, ge=16)
    draft_top_k: int = Field(16, ge=1, le=1024)
    context_projection: Literal["verifier", "drafter"] = "verifier"
    feature_dtype: Literal["model", "bfloat16", "float16"] = "model"
    draft_ahead: bool = True
    relay_drafts: bool = True
    chain_rounds: bool = True
    feature_transport: Literal["grpc", "collective"] = "grpc"
    feature_link_timeout_s: float = Field(30.0, gt=0)
    graphs: Literal["auto", "capture", "static", "off"] = "auto"
    graph_prefill_rows: int = Field(512, ge=0, le=65536)


class ServiceLevelsConfig(_Strict):
    """Server defaults for the per-request service levels (docs/HTTP_API.md "Service levels";
    :mod:`scheduler.service_levels`): what a request that does not set ``speculative`` / ``priority`` /
    ``tpot_slo_ms`` gets, what happens to a request whose target cannot be met at admission (``refuse``: 429 +
    ``Retry-After``; ``queue``: it waits), and ``on_target_weight``, the factor on the survival probabilities
    of requests that are not behind a target (1 = no lateness weighting), ``pause_lower_tiers``: whether the
    requests of a lower tier than a late request sit out its rounds, and ``slo_attainment``: the share of each
    tier's requests with a target meant to meet it, which the scheduler paces the tier for (null: pace every
    request at its target itself), and ``join_hold_ms``: while a request with a target runs, how long a prompt may
    wait to join so that prompts join rounds together and the rounds between are chained (0: at once)."""

    default_priority: int = Field(0, ge=-100, le=100)
    default_speculative: Literal["auto", "off", "on"] = "auto"
    default_tpot_slo_ms: float | None = Field(None, gt=0, le=1e6)
    slo_admission: Literal["refuse", "queue"] = "refuse"
    on_target_weight: float = Field(0.1, gt=0, le=1)
    pause_lower_tiers: bool = False
    slo_attainment: float | None = Field(0.95, gt=0, lt=1)
    join_hold_ms: float = Field(0.0, ge=0, le=10000)

    def levels(self) -> ServiceLevels:
        """The scheduler's record of these settings."""
        return ServiceLevels(**self.model_dump())


#: ``scheduler.decode_steps: auto`` on a CUDA verifier: tokens per ``Step`` of plain decoding in the disaggregated
#: placement (as vLLM's multi-step scheduling, which runs 8-10 steps per scheduler call).
GPU_DECODE_STEPS = 8


class SchedulerConfig(_Strict):
    """``draft_cost``: what the scheduled policies (``dspark``, ``dspark-async``) charge for drafting: ``none``
    (Algorithm 1's plain objective; the drafter runs every round) or ``measured`` (each round loop learns the
    draft time per round, gRPC round trip included, from its own timings, and charges it: Algorithm 1 maximises
    tokens per second of the whole round and a round skips the drafter when a plain target round is predicted
    faster; lossless either way). Other policies ignore it.

    ``service_levels``: the defaults of per-request service levels (:class:`ServiceLevelsConfig`).

    ``request_groups``: more than 1 splits each verifier replica's requests into that many groups and verifies
    one group while its drafters draft the next group's blocks (:mod:`scheduler.pipeline`). It pays when drafting
    and verifying run on separate devices AND their step times grow with the batch (compute-bound batches); with
    step times flat in the batch (small batches on a GPU) every group pays the whole step, so keep 1 there
    (docs/benchmarks/data_plane.md has the measurements).

    ``decode_steps``: with the ``autoregressive`` policy in the disaggregated placement, each round decodes up
    to this many tokens per request in one ``Step`` to the verifier replica (one message each way per that many
    tokens instead of per token); a prompt that arrives meanwhile joins at the next round, so 1 gives the lowest
    time to first token under load, and tokens stream in bursts of that many. ``auto`` (the default) is
    :data:`GPU_DECODE_STEPS` on a CUDA verifier, where the message is a large part of a decoding step, and 1
    elsewhere, where it is not (:meth:`decode_steps_on`). The in-process placement decodes one token per round.

    ``chain_tolerance``: with ``dspark``, how much of Algorithm 1's objective a uniform length planned before the
    drafts exist may give up for the round to be planned (chained in process, relayed disaggregated) rather than
    decided on its own confidences (:mod:`scheduler.chain_plan`); 0 plans only where the plan is Algorithm 1's
    own decision. Lossless at any value: a plan depends on counts and earlier rounds' confidences only.

    ``drain_timeout_s``: how long a drafter or verifier replica that Serve stops (autoscaling down, rolling
    update) keeps serving the requests it holds before it goes; keep the deployment's
    ``graceful_shutdown_timeout_s`` above it (``build_app`` defaults it to this plus a margin)."""

    policy: str = "dspark"
    draft_cost: Literal["none", "measured"] = "none"
    max_running_per_verifier: int | None = Field(None, ge=1)
    request_groups: int = Field(1, ge=1, le=8)
    decode_steps: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"
    chain_tolerance: float = Field(CHAIN_TOLERANCE, ge=0, le=1)
    drain_timeout_s: float = Field(120.0, gt=0)
    service_levels: ServiceLevelsConfig = ServiceLevelsConfig()

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value in ("autoregressive", "full", "dspark", "dspark-async") or value.startswith("fixed-"):
            return value
        raise ValueError("policy must be autoregressive, fixed-N, full, dspark or dspark-async")

    def decode_steps_on(self, device: str) -> int:
        """``decode_steps`` for a verifier on ``device`` (``auto`` resolved: see the class docstring)."""
        if self.decode_steps != "auto":
            return self.decode_steps
        return GPU_DECODE_STEPS if device.startswith("cuda") else 1


_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class NetworkConfig(_Strict):
    """The data plane binds to ``grpc_host`` (default: this node's Ray address, never 0.0.0.0 unless asked).

    ``readiness_timeout_s``: how long a request that arrives while no verifier replica accepts requests (the
    deployment is starting, or lost its replicas) waits for one before it is refused with a 503 and
    ``Retry-After``; 0 refuses at once. It also bounds how long the ingress waits for a restarted scheduler to
    continue a stream that its predecessor's death cut (:mod:`cluster.remote_backend`).

    Secrets can be given inline (``grpc_token``, ``api_key``) or, better on a cluster, by the NAME of an
    environment variable that every replica reads at start (``grpc_token_env``, ``api_key_env``), e.g. filled from
    a Kubernetes Secret: the config file, the Serve controller's stored config and the KubeRay manifest then hold
    no secret. :meth:`AppConfig.resolve_secrets` does the reading, in the replicas only.

    Secure by default: the data plane needs a token, and a replica refuses to start without one, unless
    ``grpc_insecure: true`` says explicitly that it runs open (a trusted single-user machine, tests). Without a
    token anyone who reaches a gRPC port could generate past the HTTP API key (``Scheduler/Generate``) or take
    every KV slot (``Verifier/Step``). ``dspark serve`` on its embedded cluster generates a token itself.
    """

    grpc_host: str | None = None
    grpc_token: str | None = None
    grpc_token_env: str | None = Field(None, pattern=_ENV_NAME)
    grpc_insecure: bool = False
    grpc_timeout_s: float = Field(60.0, gt=0)
    readiness_timeout_s: float = Field(30.0, ge=0, le=3600)
    api_key: str | None = None
    api_key_env: str | None = Field(None, pattern=_ENV_NAME)

    @model_validator(mode="after")
    def _one_source_per_secret(self) -> NetworkConfig:
        for name in ("grpc_token", "api_key"):
            if getattr(self, name) is not None and getattr(self, f"{name}_env") is not None:
                raise ValueError(f"set {name} or {name}_env, not both")
        if self.grpc_insecure and (self.grpc_token is not None or self.grpc_token_env is not None):
            raise ValueError("grpc_insecure runs the data plane without a token: set it or a token, not both")
        return self


class AppConfig(_Strict):
    """Everything ``cluster.app.build_app`` needs; the ``args`` of the Serve application.

    ``placement``: ``disaggregated`` (drafter and verifier deployments on their own pools, the scheduler's
    round loops between them over gRPC) or ``colocated`` (one ``Engine`` deployment whose replicas each hold both
    engines on one device and run the round pipeline in process, on the ``verify_pool``; the scheduler admits
    and routes requests to them). docs/DEPLOYMENT.md says when each pays.

    ``cache_dir``: where profiled SPS tables are kept between starts (``<cache_dir>/sps``, see
    :mod:`cluster.sps_cache`), with Triton's kernels (:mod:`cluster.compile_cache`) and the scheduler's
    detokeniser (:mod:`cluster.tokenizer_cache`); default ``$DSPARK_CACHE_DIR``, else ``~/.cache/dspark``. Each
    replica resolves it on its own node, so on a cluster it should be a volume that outlives the pod
    (docs/DEPLOYMENT.md).

    ``spare_workers``: idle Ray workers the Scheduler replica keeps on every node, so that a replica which dies
    restarts in one (:mod:`cluster.spare_workers`); they pay only on a cluster whose workers preload the
    application (``dspark serve``'s embedded cluster does; a RayService through every pod's environment,
    :func:`cluster.spare_workers.preload_environment`, docs/DEPLOYMENT.md). ``dspark serve --spare-workers`` sets
    it."""

    model_name: str = "dspark-demo"
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    cache_dir: str | None = None
    spare_workers: int = Field(0, ge=0, le=64)
    models: ModelConfig = ModelConfig()
    draft_pool: PoolConfig = PoolConfig(resource="draft_pool")
    verify_pool: PoolConfig = PoolConfig(resource="verify_pool")
    engine: EngineConfig = EngineConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    network: NetworkConfig = NetworkConfig()

    @property
    def cache_path(self) -> Path:
        """``cache_dir`` resolved (the environment is read here, in the process that uses the cache)."""
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        env = os.environ.get("DSPARK_CACHE_DIR")
        return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark"

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        """Validate the Serve ``args`` map (errors name the offending field)."""
        return cls.model_validate(args or {})

    def require_grpc_auth(self) -> None:
        """Raise unless the data plane has a token (inline or by variable name) or is explicitly insecure."""
        network = self.network
        if network.grpc_token is None and network.grpc_token_env is None and not network.grpc_insecure:
            raise ValueError(
                "the gRPC data plane needs a token: set network.grpc_token_env (the name of an environment "
                "variable every replica has) or network.grpc_token, or network.grpc_insecure: true to run it "
                "without authentication (dspark serve on its own embedded cluster generates one)"
            )

    def resolve_secrets(self) -> AppConfig:
        """A copy with ``grpc_token`` / ``api_key`` read from the environment variables named by ``*_env``.

        Called where the secrets are used (each replica), never where the config is stored or forwarded, so the
        secret values stay out of Serve's deployment arguments. A named variable that is unset or empty is an
        error: serving without the expected token or key must not happen silently. So is a data plane without a
        token that is not explicitly ``grpc_insecure`` (see :class:`NetworkConfig`).
        """
        self.require_grpc_auth()
        update: dict[str, Any] = {}
        for name in ("grpc_token", "api_key"):
            variable = getattr(self.network, f"{name}_env")
            if variable is None:
                continue
            value = os.environ.get(variable)
            if not value:
                raise ValueError(f"network.{name}_env: environment variable {variable} is not set")
            update[name] = value
            update[f"{name}_env"] = None
        if not update:
            return self
        return self.model_copy(update={"network": self.network.model_copy(update=update)})
