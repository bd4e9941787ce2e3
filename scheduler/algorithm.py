"""Algorithm 1 of DSpark: causal greedy prefix admission with the early stop, vectorised.

Every round the scheduler gets, for the R active requests of one verifier replica, the confidences c[r, j] (j
= 1..gamma) of their freshly drafted blocks and returns l_r, how many draft tokens each request verifies.

The walk, as in the paper:
  a[r, j] = prod_{i<=j} c[r, i]    (prefix survival probability, non-increasing in j)
  sort all (r, j) with a[r, j] > 0 by a, descending
  start: l = 0, B = R, tau = R, Theta_0 = objective(tau, B)
  n-th item (r, j): l_r = j, B += 1, tau += a[r, j], Theta_n = objective(tau, B)
  continue while Theta_n > Theta_{n-1}, else stop (the early stop)
  objective = tau * SPS(B), or with the draft-cost term tau / (T_draft(R, B) + 1 / SPS(B))

Vectorised form: one sort, cumulative sums of tau along the sorted order, Theta for every prefix in one array
expression, and the early stop = the FIRST n where Theta stops improving (never a global argmax, see below).
The admitted set is the first n* items of the sorted order; l_r counts the admitted items of request r.

Tie-break (value-independent): survival descending, then position ascending, then request index ascending. The
sort key packs the float64 survival bits (highest ~50 bits) with the index j * R + r, so one unsigned-integer
sort does all three; survivals closer than ~2^-(52 - log2(R * gamma)) relative to each other count as ties.

Why the sorted order admits prefixes: a[r, j + 1] = a[r, j] * c[r, j + 1] <= a[r, j], and at equal survival
the smaller position sorts first, so (r, j) precedes (r, j + 1) in the walk. Any prefix of the walk therefore
contains (r, j) only if it contains (r, 1..j-1): l_r = number of admitted items of r is a valid prefix length.

Why the early stop keeps sampling lossless (and a global argmax does not): the confidence head reads the
sampled token x[r, j-1], so a[r, j] is a function of x[r, 1..j-1], and a[r, j+1] is a function of x[r, j].
Admitting x[r, j] must not depend on x[r, j] itself, otherwise the verifier sees x[r, j] only for favourable
values of x[r, j] and the output distribution is biased (the paper's Appendix A;
tests/scheduler/test_sched_appendix_a.py). With the early stop, "x[r, j] is admitted" means "Theta improved at
every step of the walk up to and including (r, j)". Those Theta values depend only on the items that precede
(r, j) in the walk and on (r, j) itself. Items of request r that precede it are (r, 1..j-1): functions of x[r,
1..j-2]. Items of other requests do not depend on x[r, j] (each request's draft is sampled independently).
Items (r, j' > j), the only ones that see x[r, j], always come after (r, j) and so cannot influence its
admission. Hence {l_r >= j} is decided by quantities fixed before x[r, j] is known: a predictable stopping
rule, under which per-token rejection sampling stays exact. A global argmax over all prefixes would also look
at Theta after (r, j + 1), which reads x[r, j]: that is the retrospective search the paper rules out.

The draft-cost term keeps this property because the round time T_draft(R, B) + 1 / SPS(B) depends on the walk
only through the number of admitted items (B = R + n): Theta_n is still a function of the first n items of the
walk.

Fast path (every step improves): at small R the walk is dominated by fixed per-call costs, and when the SPS
curve is nearly flat over the batch sizes the round can reach (B = R .. R + n_pos) every positive item improves
Theta, so the early stop admits all of them and l_r = the number of positive survivals of request r; then the
sort, the Theta path and the bincount are skipped (:func:`every_step_improves` states and proves the test).
The decision is the same as the walk's, bit for bit (tests/scheduler/test_sched_fast_path.py).

Zero survival is never admitted. Survivals below 2^-960 are treated as zero: added to tau >= 1 they round to
nothing, so Theta could not improve there (SPS is non-increasing in B and the draft cost non-decreasing) and
the walk would stop at them anyway; flushing them makes zeros sort strictly last. Empty batches (R = 0) return
an empty length array; gamma = 0 returns zeros.

The walk's steps (:func:`survival_probabilities`, :func:`walk_order`, :func:`walk_prices`, :func:`theta_path`,
:func:`early_stop`, :func:`lengths_of_prefix`, :func:`every_step_improves`, :func:`positive_counts`, on the
per-thread :class:`Workspace`) are public: the asynchronous variant (:mod:`scheduler.async_capacity`) walks the
same way with another stopping rule.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from operator import mul, truediv

import numpy as np

from scheduler.sps import SPSTable

_TINY = 2.0**-960
# Reductions called as ufunc methods: ndarray.min / sum / cumsum and np.count_nonzero(axis=) wrap them in Python
# layers that cost more than the work itself on the few hundred elements of a small-R round.
_minimum, _maximum, _add, _accumulate = np.minimum.reduce, np.maximum.reduce, np.add.reduce, np.add.accumulate
# Fast-path margins (see every_step_improves): far above float64 rounding (~1e-16 per operation, 3 * n * 1e-16
# over a sum of n <= _FAST_PATH_MAX_ITEMS survivals), far below any gain that matters to the decision.
_MARGIN = 1e-9
_FAST_PATH_MAX_ITEMS = 1 << 20
# Up to this many items (R * gamma) the walk runs on Python floats (scalar_round, for Algorithm 1 and for the
# asynchronous variant): a round of 1-3 requests is then a few dozen float operations instead of ~25 numpy calls,
# whose fixed cost is the whole schedule time there; the numpy walk is faster from R = 4 at gamma 7
# (docs/benchmarks/scheduler.md, "One round at small R").
_SCALAR_MAX_ITEMS = 24
_FLIP = 0xFFFF_FFFF_FFFF_FFFF
# Neighbours of the scalar walk's float sort closer than this ratio may share the packed key's survival bits.
_NEAR_TIE = 1.0 + 2.0**-40


@dataclass(frozen=True)
class DraftCost:
    """Draft time per round: T_draft(R, B) = fixed_s + per_request_s * R + per_token_s * B.

    The objective becomes expected accepted tokens per second of the WHOLE round, tau / (T_draft + 1/SPS(B)),
    as in adaptive speculation schemes (vLLM's included) that charge the drafter's time against the speed-up.
    R is fixed within a round, so `fixed_s + per_request_s * R` only shifts the round time (it makes verifying
    more tokens relatively cheaper); `per_token_s` charges drafter work that grows with the verified batch
    (e.g. ingesting the context features of verified positions next round). All terms are >= 0 so the round
    time never decreases with B.
    """

    fixed_s: float = 0.0
    per_request_s: float = 0.0
    per_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_request_s", "per_token_s"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (ok and math.isfinite(value) and value >= 0):
                raise ValueError(f"DraftCost.{name} must be a finite number >= 0, got {value!r}")

    def scaled(self, factor: float) -> DraftCost:
        """Every term times ``factor`` (finite, > 0). Dividing both round costs by k prices the verify step k
        times as long: Theta = tau / (T_draft + k / SPS) = k * tau / (T_draft / k + 1 / SPS), a constant factor
        that changes no comparison Algorithm 1 or the draft gate makes (scheduler.draft_cost_estimate)."""
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"DraftCost scale factor must be a finite number > 0, got {factor!r}")
        return DraftCost(self.fixed_s * factor, self.per_request_s * factor, self.per_token_s * factor)

    def seconds(self, num_requests: int, batch_tokens: np.ndarray | int) -> np.ndarray:
        """Draft time for each candidate batch size (vectorised over B; one B gives a 0-d array)."""
        return self.fixed_s + self.per_request_s * num_requests + self.per_token_s * np.asarray(batch_tokens)


@dataclass(frozen=True)
class GreedyPath:
    """The full walk of Algorithm 1 (for inspection, tests and the asynchronous planner; not the hot path).

    `requests[n]`, `positions[n]` (1-based) and `survival[n]` describe the n-th candidate (survival > 0) in
    walk order; `theta[n]` is the objective after admitting the first n candidates (theta[0]: anchors only).
    `stop` is the early-stop prefix length n* that Algorithm 1 admits; the walk goes on past it only for
    inspection.
    """

    requests: np.ndarray
    positions: np.ndarray
    survival: np.ndarray
    theta: np.ndarray
    stop: int


_real_dtypes: dict[np.dtype, bool] = {}  # dtype -> accepted (np.issubdtype is slow next to a dict lookup)


def _is_real(dtype: np.dtype) -> bool:
    real = _real_dtypes.get(dtype)
    if real is None:
        real = _real_dtypes[dtype] = dtype != np.bool_ and (
            np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)
        )
    return real


def validate_confidences(confidences: np.ndarray) -> np.ndarray:
    """`confidences` as a 2-D real array, or ValueError (NaN, inf, outside [0, 1], bad shape)."""
    conf = np.asarray(confidences)
    if conf.ndim != 2:
        raise ValueError(f"confidences must have shape [R, gamma], got shape {conf.shape}")
    if not _is_real(conf.dtype):
        raise ValueError(f"confidences must be real numbers, got dtype {conf.dtype}")
    if conf.size and not (_minimum(conf, axis=None) >= 0 and _maximum(conf, axis=None) <= 1):  # NaN fails both
        bad = np.argwhere(~((conf >= 0) & (conf <= 1)))[0]
        raise ValueError(
            f"confidences must be finite and in [0, 1]; got {conf[tuple(bad)]!r} at request {bad[0]}, "
            f"position {bad[1] + 1}"
        )
    return conf


class Workspace:
    """Per-thread preallocated buffers, grown to the largest R * gamma seen (no steady-state allocation)."""

    def __init__(self) -> None:
        self.capacity = 0
        self._grow(4096)

    def _grow(self, n: int) -> None:
        self.capacity = max(n, 2 * self.capacity)
        cap = self.capacity
        self.survival = np.empty(cap, dtype=np.float64)
        self.keys = np.empty(cap, dtype=np.uint64)
        self.index = np.arange(cap, dtype=np.uint64)
        self.order = np.empty(cap, dtype=np.uint64)
        self.theta = np.empty(cap + 1, dtype=np.float64)
        self.improving = np.empty(cap, dtype=np.bool_)
        self.requests = np.empty(cap, dtype=np.uint64)

    def ensure(self, n: int) -> None:
        if n > self.capacity:
            self._grow(n)


_local = threading.local()


def thread_workspace() -> Workspace:
    workspace = getattr(_local, "workspace", None)
    if workspace is None:
        workspace = _local.workspace = Workspace()
    return workspace


def survival_probabilities(conf: np.ndarray, ws: Workspace) -> tuple[np.ndarray, int, float]:
    """Survival probabilities a[r, j] (flat, index j * R + r; below _TINY flushed to 0), how many are > 0 and
    the smallest of those (1.0 if none). Usually none is below _TINY: one minimum then answers all three."""
    num_requests, gamma = conf.shape
    n = num_requests * gamma
    ws.ensure(n)
    survival = ws.survival[:n]
    grid = survival.reshape(gamma, num_requests)
    np.copyto(grid, conf.T)
    np.multiply.accumulate(grid, axis=0, out=grid)
    if n == 0:
        return survival, 0, 1.0
    smallest = float(_minimum(survival))
    if smallest >= _TINY:
        return survival, n, smallest
    np.copyto(survival, 0.0, where=survival < _TINY)
    return survival, int(np.count_nonzero(survival)), float(survival.min(initial=1.0, where=survival > 0))


def walk_order(survival: np.ndarray, n_pos: int, ws: Workspace) -> np.ndarray:
    """The walk: flat indices j * R + r of the n_pos positive survivals in Algorithm 1's order."""
    n = survival.size
    # Key = high bits of ~float_bits(a) (descending a) | flat index j * R + r (position asc, then request
    # asc): the low `shift` bits of ~float_bits(a) are cleared (x & ~low, i.e. (x >> shift) << shift) for the index.
    low = (1 << max(1, (n - 1).bit_length())) - 1
    keys = ws.keys[:n]
    np.invert(survival.view(np.uint64), out=keys)
    np.bitwise_and(keys, np.uint64(low ^ 0xFFFF_FFFF_FFFF_FFFF), out=keys)
    np.bitwise_or(keys, ws.index[:n], out=keys)
    keys.sort()
    order = ws.order[:n_pos]
    np.bitwise_and(keys[:n_pos], np.uint64(low), out=order)
    return order.view(np.int64)


def _sorted_walk(conf: np.ndarray, ws: Workspace) -> tuple[np.ndarray, np.ndarray, int]:
    """Survival probabilities (flat, index j * R + r) and the walk order over the n_pos positive ones."""
    survival, n_pos, _ = survival_probabilities(conf, ws)
    return survival, walk_order(survival, n_pos, ws), n_pos


@dataclass(frozen=True)
class WalkPrices:
    """What the walk of R requests x gamma positions multiplies tau by, for one SPS table and draft cost.

    ``factor[n]`` prices batch B = R + n: Theta_n = tau_n * factor[n] (plain objective, factor = SPS(B)) or
    tau_n / factor[n] (draft cost, factor = T_draft(R, B) + 1 / SPS(B)). ``growth[n]`` bounds how much the
    price worsens from B = R to R + n: the largest relative step max_{k<=n} factor ratio - 1 (>= 0, the curve
    is monotone), what one more token must beat for Theta to improve (see every_step_improves). Both depend
    on R, gamma, the table and the draft cost only, so they are built once (SPSTable.memo), not per round.
    """

    factor: np.ndarray
    growth: np.ndarray
    divide: bool


def walk_prices(sps: SPSTable, draft_cost: DraftCost | None, num_requests: int, gamma: int) -> WalkPrices:
    def build() -> WalkPrices:
        last_b = num_requests * (gamma + 1)
        if draft_cost is None:
            factor = sps.dense(last_b)[num_requests : last_b + 1]
            ratio = factor[:-1] / factor[1:]  # SPS(B - 1) / SPS(B) >= 1
        else:
            batch = np.arange(num_requests, last_b + 1, dtype=np.float64)
            factor = sps.dense_step_time(last_b)[num_requests : last_b + 1] + draft_cost.seconds(num_requests, batch)
            ratio = factor[1:] / factor[:-1]  # round time T(B) / T(B - 1) >= 1
        growth = np.zeros(factor.size)
        np.maximum.accumulate(ratio - 1.0, out=growth[1:])
        return WalkPrices(factor, growth, draft_cost is not None)

    return sps.memo(("algorithm1", draft_cost, num_requests, gamma), build)


def every_step_improves(total: float, n_pos: int, smallest: float, num_requests: int, growth: float) -> bool:
    """A sufficient test, without the sort, that Theta strictly improves at EVERY step of the walk as computed;
    the one test of both walks (the numpy walk and :func:`scalar_round`).

    Then the early stop admits all n_pos positive items (and the global argmax of Theta is the last prefix),
    whatever their order. Claim: if a_min > (R + S)(1 + m)(G + m), with a_min = ``smallest`` positive survival,
    S = ``total`` the sum of all of them (summed in any order), G = ``growth`` = _Prices.growth[n_pos] and
    m = _MARGIN = 1e-9, every step n = 1..n_pos has
    Theta_n > Theta_{n-1} in float64.

    Proof. Write u = 2^-53, t_k the computed tau after k items (t_0 = R), p_k = factor[k] and
    g_k = p_{k-1} / p_k - 1 (plain) or p_k / p_{k-1} - 1 (draft cost), so G >= computed g_k >= g_k - 2u(1+g_k).
    Step n improves in exact arithmetic iff a_n / t_{n-1} > g_n: tau grows by the factor 1 + a_n / t_{n-1}
    while the price worsens by 1 + g_n. The computed values carry relative errors: t_n = (t_{n-1} + a_n)(1+d)
    and Theta_k = t_k p_k (1+e) or t_k / p_k (1+e), |d|, |e| <= u, so the computed step improves whenever
    1 + a_n / t_{n-1} > (1 + g_n)(1 + 4u), which holds if a_n / t_{n-1} > G + 7u(1 + G). Every cumulative sum
    of non-negative terms is at most R + S (exact) times (1 + n_pos u), and the computed S is within n_pos u
    of the exact one: t_{n-1} <= (R + S)(1 + 3 n_pos u) < (R + S)(1 + m) for n_pos <= 2^20. With a_n >= a_min:
    a_n / t_{n-1} > (R + S)(1 + m)(G + m) / ((R + S)(1 + m)) = G + m > G + 7u(1 + G) while G < 1e6 (a larger
    G cannot pass the test: a_min <= 1 < G * R). Evaluating the test itself in float64 moves each side by a few
    u relative, well inside m.
    """
    if n_pos > _FAST_PATH_MAX_ITEMS:
        return False
    return smallest > (num_requests + total) * (1.0 + _MARGIN) * (growth + _MARGIN)


def positive_counts(survival: np.ndarray, num_requests: int) -> np.ndarray:
    """l_r when every positive item is admitted: survival is non-increasing in j, so a prefix of each row."""
    return _add(survival.reshape(-1, num_requests) > 0, axis=0, dtype=np.int64)


def theta_path(
    survival: np.ndarray, order: np.ndarray, num_requests: int, prices: WalkPrices, ws: Workspace
) -> np.ndarray:
    """Theta_n for n = 0..n_pos along the walk (a view into the workspace)."""
    n_pos = order.size
    theta = ws.theta[: n_pos + 1]
    theta[0] = num_requests
    np.take(survival, order, out=theta[1:])
    _accumulate(theta, out=theta)  # tau_n = R + sum of the first n survivals (sequentially, in walk order)
    if prices.divide:
        np.divide(theta, prices.factor[: n_pos + 1], out=theta)
    else:
        np.multiply(theta, prices.factor[: n_pos + 1], out=theta)
    return theta


def early_stop(theta: np.ndarray, ws: Workspace) -> int:
    """n* = the last n such that Theta strictly improved at every step 1..n (the causal early stop)."""
    steps = theta.size - 1
    if steps == 0:
        return 0
    improving = ws.improving[:steps]
    np.greater(theta[1:], theta[:-1], out=improving)
    first = int(improving.argmin())
    return steps if improving[first] else first


def lengths_of_prefix(order: np.ndarray, count: int, num_requests: int, ws: Workspace) -> np.ndarray:
    """l_r = number of request r's items in the first `count` of the walk (a valid prefix: module doc)."""
    requests = ws.requests[:count]
    np.remainder(order[:count].view(np.uint64), np.uint64(num_requests), out=requests)
    return np.bincount(requests.view(np.int64), minlength=num_requests)


def _scalar_prices(
    sps: SPSTable, draft_cost: DraftCost | None, num_requests: int, gamma: int
) -> tuple[list[float], list[float], bool]:
    """:func:`walk_prices` as Python lists (factor, growth, divide), for the scalar walk; memoised alike."""

    def build() -> tuple[list[float], list[float], bool]:
        prices = walk_prices(sps, draft_cost, num_requests, gamma)
        return prices.factor.tolist(), prices.growth.tolist(), prices.divide

    return sps.memo(("algorithm1-scalar", draft_cost, num_requests, gamma), build)


def takes_scalar_walk(conf: np.ndarray) -> bool:
    """Whether a round's confidences (as given, unvalidated) take :func:`scalar_round`: a real 2-D array of
    0 < R * gamma <= _SCALAR_MAX_ITEMS (read through the module, so tests can move the limit)."""
    return conf.ndim == 2 and 0 < conf.size <= _SCALAR_MAX_ITEMS and _is_real(conf.dtype)


def _packed_walk(survival: list[float]) -> list[int]:
    """The walk's order by the packed sort key of :func:`_walk_order` (survival bits above ``shift``, then the
    flat index j * R + r), on Python ints: all n flat indices, zeros last."""
    n = len(survival)
    shift = max(1, (n - 1).bit_length())
    low = (1 << shift) - 1
    bits = struct.unpack(f"{n}Q", struct.pack(f"{n}d", *survival))
    return [key & low for key in sorted((((b ^ _FLIP) >> shift) << shift) | i for i, b in enumerate(bits))]


def scalar_round(
    conf: np.ndarray,
    sps: SPSTable,
    draft_cost: DraftCost | None,
    num_requests: int,
    gamma: int,
    capacity: int | None,
    *,
    plan: bool,
) -> tuple[np.ndarray, int]:
    """One small round's walk (0 < R * gamma <= _SCALAR_MAX_ITEMS) on Python floats: the lengths (Algorithm 1's
    early stop, or with ``capacity`` its first ``capacity`` items: the asynchronous variant's admission) and, with
    ``plan``, the first argmax of Theta over all prefixes (the asynchronous variant's capacity plan; without
    ``plan`` the walk may end at its early stop and the returned plan is 0).

    It decides exactly what the vectorised paths decide: the same IEEE operations in the same order (survival
    products along each row in float64, tau summed sequentially along the walk, Theta = tau * or / the same
    factors), the same walk order and the same sufficient test :func:`every_step_improves` (its S summed row by
    row, an order its proof allows: a pass is as sound, and a failed test only means the walk runs and finds the
    same answer). The order: a stable sort of the survivals, descending (equal ones by flat index j * R + r),
    is the packed key's order (:func:`_walk_order`) unless two unequal survivals share the key's survival bits,
    which needs them within a factor 1 + 2^(shift - 52) of each other; when two neighbours of the sorted order are
    within 1 + 2^-40 (shift <= 5 here) the packed key itself orders them. ``conf``: a real 2-D array whose values
    are checked here (outside [0, 1] or NaN: validate_confidences raises the vectorised path's error)."""
    columns = []  # per request: its survivals along the row (flushed to 0 from the first below _TINY on)
    counts = []  # per request: how many are positive
    n_pos, total, smallest = 0, 0.0, 1.0
    values = conf.ravel().tolist()  # row after row
    if not (min(values) >= 0.0 and max(values) <= 1.0 and sum(values) >= 0.0):  # a NaN fails the sum, wherever
        validate_confidences(conf)  # raises the error the vectorised path raises
    for start in range(0, num_requests * gamma, gamma):
        # Non-increasing along the row: the positives are a prefix of it.
        survival = list(accumulate(values[start : start + gamma], mul))
        if survival[-1] >= _TINY:
            positive = gamma
        else:
            positive = 0
            while survival[positive] >= _TINY:
                positive += 1
            survival[positive:] = [0.0] * (gamma - positive)
        if positive:
            n_pos += positive
            total += sum(survival)
            if survival[positive - 1] < smallest:
                smallest = survival[positive - 1]
        columns.append(survival)
        counts.append(positive)
    check_sps(sps)
    if n_pos == 0:
        return np.zeros(num_requests, dtype=np.int64), 0
    factor, growth, divide = _scalar_prices(sps, draft_cost, num_requests, gamma)
    improves = every_step_improves(total, n_pos, smallest, num_requests, growth[n_pos])
    if improves and (capacity is None or capacity >= n_pos):  # admit every positive item; Theta peaks last
        return np.array(counts, dtype=np.int64), n_pos if plan else 0
    # The survivals flat, index j * R + r, as the vectorised path lays them out.
    flat = columns[0] if num_requests == 1 else [a for column in zip(*columns, strict=True) for a in column]
    walk = sorted(range(len(flat)), key=flat.__getitem__, reverse=True)[:n_pos]
    if n_pos > 1:
        values = list(map(flat.__getitem__, walk))
        if min(map(truediv, values, values[1:])) <= _NEAR_TIE:
            walk = _packed_walk(flat)[:n_pos]
    counts = [0] * num_requests
    if capacity is not None:  # top-capacity admission (and the plan, if asked, from the same walk below)
        for index in walk[:capacity]:
            counts[index % num_requests] += 1
        if improves or not plan:  # with plan, improves: Theta peaks at the last prefix
            return np.array(counts, dtype=np.int64), n_pos if plan else 0
    tau = float(num_requests)
    previous = best = tau / factor[0] if divide else tau * factor[0]
    best_step, stopped = 0, capacity is not None
    for step, index in enumerate(walk, 1):  # the walk: up to its early stop, or all of it for the plan
        tau += flat[index]
        theta = tau / factor[step] if divide else tau * factor[step]
        if theta > best:
            best, best_step = theta, step
        if not stopped:
            if theta > previous:
                previous = theta
                counts[index % num_requests] += 1
            else:
                stopped = True
                if not plan:
                    break
    return np.array(counts, dtype=np.int64), best_step if plan else 0


def check_sps(sps: SPSTable) -> None:
    if not isinstance(sps, SPSTable):
        raise ValueError(f"sps must be an SPSTable, got {type(sps).__name__}")


def schedule_lengths(
    confidences: np.ndarray,
    sps: SPSTable,
    *,
    draft_cost: DraftCost | None = None,
) -> np.ndarray:
    """Algorithm 1: verification lengths l_r (int64 [R], 0 <= l_r <= gamma) for confidences [R, gamma].

    The verify batch then holds B = sum_r (1 + l_r) tokens. Raises ValueError on NaN / out-of-range
    confidences or a non-SPSTable; R = 0 gives an empty array.
    """
    conf = np.asarray(confidences)
    if takes_scalar_walk(conf):
        num_requests, gamma = conf.shape
        return scalar_round(conf, sps, draft_cost, num_requests, gamma, None, plan=False)[0]
    conf = validate_confidences(conf)
    check_sps(sps)
    num_requests, gamma = conf.shape
    if num_requests == 0 or gamma == 0:
        return np.zeros(num_requests, dtype=np.int64)
    ws = thread_workspace()
    survival, n_pos, smallest = survival_probabilities(conf, ws)
    prices = walk_prices(sps, draft_cost, num_requests, gamma)
    if n_pos == 0 or every_step_improves(
        float(_add(survival)), n_pos, smallest, num_requests, float(prices.growth[n_pos])
    ):
        return positive_counts(survival, num_requests)
    order = walk_order(survival, n_pos, ws)
    theta = theta_path(survival, order, num_requests, prices, ws)
    return lengths_of_prefix(order, early_stop(theta, ws), num_requests, ws)


def greedy_path(
    confidences: np.ndarray,
    sps: SPSTable,
    *,
    draft_cost: DraftCost | None = None,
) -> GreedyPath:
    """The whole walk of Algorithm 1 with Theta for every prefix (copies; for analysis and tests; it never
    takes the fast path, so it is also the reference the fast path is tested against)."""
    conf = validate_confidences(confidences)
    check_sps(sps)
    num_requests, gamma = conf.shape
    if num_requests == 0:
        empty = np.zeros(0, dtype=np.int64)
        return GreedyPath(empty, empty, np.zeros(0), np.zeros(1), 0)
    ws = thread_workspace()
    survival, order, _ = _sorted_walk(conf, ws)
    theta = theta_path(survival, order, num_requests, walk_prices(sps, draft_cost, num_requests, gamma), ws)
    return GreedyPath(
        requests=order % num_requests,
        positions=order // num_requests + 1,
        survival=survival[order],
        theta=theta.copy(),
        stop=early_stop(theta, ws),
    )


# Above this many items a round's packed sort key keeps fewer than 52 - 12 survival bits, and the float order of
# schedule_lengths_rounds could differ from it beyond what its near-tie check sees: such rounds walk one by one.
# The check itself: neighbours of the walk whose float64 bits differ by less than this.
_ROUNDS_MAX_ITEMS = 1 << 12
_ONE_BIT, _NEAR_BITS = np.uint64(1), np.uint64(_ROUNDS_MAX_ITEMS - 1)


_ONES_U8 = np.ones(256, dtype=np.uint8)  # sums of up to 255 flags in one uint8 product
_round_factor_cache: dict[tuple[object, ...], np.ndarray] = {}


def _round_factors(
    table_for: Callable[[int], SPSTable], draft_cost: DraftCost | None, width: int, gamma: int
) -> np.ndarray:
    """[width + 1, width * gamma + 1]: row R holds the walk's factors of a round of R requests (walk_prices), then
    0 (plain objective) or infinity (draft cost) past its last batch size, where no step can improve Theta."""
    key = (table_for, draft_cost, width, gamma)
    factors = _round_factor_cache.get(key)
    if factors is None:
        if len(_round_factor_cache) >= 64:
            _round_factor_cache.clear()
        factors = np.full((width + 1, width * gamma + 1), 0.0 if draft_cost is None else np.inf)
        for count in range(1, width + 1):
            factor = walk_prices(table_for(count), draft_cost, count, gamma).factor
            factors[count, : factor.size] = factor
        factors.flags.writeable = False
        _round_factor_cache[key] = factors
    return factors


def schedule_lengths_rounds(
    confidences: np.ndarray,
    num_requests: np.ndarray,
    table_for: Callable[[int], SPSTable],
    *,
    draft_cost: DraftCost | None = None,
) -> np.ndarray:
    """Algorithm 1 on a stack of independent rounds at once: the same decision as :func:`schedule_lengths` for
    every round, in one vectorised walk (a simulator's many small rounds: the fixed cost of the walk's numpy calls
    is paid once for all of them).

    ``confidences`` [N, R, gamma]: round k's requests are rows ``0 .. num_requests[k] - 1`` (the rows past them
    are padding, ignored); ``table_for(R)``: the SPS table that prices a round of R requests. Returns l [N, R]
    (int64, zero on padding): ``l[k, :R_k] == schedule_lengths(confidences[k, :R_k], table_for(R_k),
    draft_cost=draft_cost)`` bit for bit (tests/scheduler/test_sched_rounds.py).

    How it stays the same decision: the survival products and tau are the same IEEE operations in the same
    order (products along each row, tau summed sequentially along the walk, Theta = tau * or / the round's own
    factors), and the early stop is the first step that does not improve Theta. Padding has zero survival, so it
    sorts after every positive item and, like any zero survival, never improves Theta (SPS is non-increasing in B,
    the draft cost non-decreasing; past a round's last batch size the factor is 0 or infinite): the walk of round
    k stops at or before its n_pos, as its own walk does. The walk's order is the survivals sorted descending,
    equal ones by flat index j * R + r (the padded index j * R_max + r orders the real items alike): the packed
    key's order (:func:`walk_order`) unless two unequal neighbours have float64 bits closer than 2^12 (the key
    keeps all but its <= 12 index bits of them; the argument of :func:`scalar_round`); such rounds, and rounds
    of more than 2^12 items, walk alone through :func:`schedule_lengths`. The fast path
    (:func:`every_step_improves`) is not taken: it is a shortcut to the walk's own answer.
    """
    conf = np.asarray(confidences)
    if conf.ndim != 3:
        raise ValueError(f"confidences must have shape [rounds, R, gamma], got shape {conf.shape}")
    rounds, width, gamma = conf.shape
    counts = _round_counts(num_requests, rounds, width)
    if rounds == 0 or width == 0 or gamma == 0:
        return np.zeros((rounds, width), dtype=np.int64)
    real = np.arange(width)[None, :] < counts[:, None]  # [N, R]: not padding
    if not (_minimum(conf, axis=None) >= 0 and _maximum(conf, axis=None) <= 1):  # NaN fails both
        validate_confidences(conf[real])  # raises unless the offending values are padding
    survival = np.multiply.accumulate(conf, axis=2)  # along each request's row, [N, R, gamma]
    if _minimum(survival, axis=None) < _TINY:
        np.copyto(survival, 0.0, where=survival < _TINY)
    grid = np.where(real[:, :, None], survival, 0.0)
    lengths, alone = _walk_rounds(grid, counts, table_for, draft_cost)
    for k in alone:  # near ties: walk alone
        count = int(counts[k])
        lengths[k] = 0
        lengths[k, :count] = schedule_lengths(conf[k, :count], table_for(count), draft_cost=draft_cost)
    return lengths


class RecordedConfidences:
    """Confidences of recorded rounds, ``table`` [rows, gamma] (validated), with their survival probabilities
    computed once (the walk's own products, flushed below 2^-960 alike): rounds that replay rows of it, such as
    a simulator's, need no products per round (:func:`schedule_recorded_rounds`)."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = validate_confidences(np.asarray(table, dtype=np.float64))
        survival = np.multiply.accumulate(self.table, axis=1)
        np.copyto(survival, 0.0, where=survival < _TINY)
        self.survival = survival
        # Whether two different positive survivals of the table lie within the walk's near-tie distance: if none
        # do, no round of its rows can hold a near tie (capping adds only zeros), and its walks skip the check.
        values = np.unique(survival[survival > 0]).view(np.uint64)
        self.near_ties = bool(np.count_nonzero(values[1:] - values[:-1] < _NEAR_BITS + _ONE_BIT))

    @property
    def gamma(self) -> int:
        return int(self.table.shape[1])


def schedule_recorded_rounds(
    recorded: RecordedConfidences,
    rows: np.ndarray,
    max_lengths: np.ndarray,
    num_requests: np.ndarray,
    table_for: Callable[[int], SPSTable],
    *,
    draft_cost: DraftCost | None = None,
    survivals: tuple[np.ndarray, np.ndarray] | None = None,
    objective: np.ndarray | None = None,
) -> np.ndarray:
    """:func:`schedule_lengths_rounds` of rounds whose confidences are rows of ``recorded``: round k's request r
    drafted the block of row ``rows[k, r]``, its confidences zeroed from position ``max_lengths[k, r]`` on (its
    cap, as :mod:`scheduler.policy` zeroes them). The same lengths as ``schedule_lengths_rounds(capped
    confidences, ...)``: a survival past the cap is a product with a zero, 0 (tests/scheduler/test_sched_rounds.py).
    ``survivals``: :func:`recorded_round_survivals` of these rounds, if the caller has them. ``objective`` [N]:
    filled with each round's Theta at its lengths, as the walk computes it (within a few ulps of tau / step
    time, with the draft cost's seconds added; +infinity for a round walked alone, and meaningless for a round
    of no request).
    """
    rounds, width = rows.shape
    counts = _round_counts(num_requests, rounds, width)
    gamma = recorded.gamma
    if rounds == 0 or width == 0 or gamma == 0:
        return np.zeros((rounds, width), dtype=np.int64)
    caps, grid = survivals if survivals is not None else recorded_round_survivals(recorded, rows, max_lengths, counts)
    lengths, alone = _walk_rounds(grid, counts, table_for, draft_cost, recorded.near_ties, objective)
    for k in alone:  # near ties: walk alone
        if objective is not None:
            objective[k] = np.inf
        count = int(counts[k])
        confidences = recorded.table[rows[k, :count]]
        capped = np.where(np.arange(gamma)[None, :] < caps[k, :count, None], confidences, 0.0)
        lengths[k] = 0
        lengths[k, :count] = schedule_lengths(capped, table_for(count), draft_cost=draft_cost)
    return lengths


def recorded_round_survivals(
    recorded: RecordedConfidences, rows: np.ndarray, max_lengths: np.ndarray, num_requests: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For rounds replaying rows ``rows`` [N, R] of ``recorded`` (round k's requests the first
    ``num_requests[k]``): their caps [N, R], 0 on padding, and the survivals :func:`schedule_recorded_rounds`
    walks [N, R, gamma] (``recorded.survival`` of the rows, zero from each cap on and on padding)."""
    caps = max_lengths * prefix_mask(rows.shape[1], np.asarray(num_requests, dtype=np.int64))  # padding: nothing
    grid = recorded.survival.take(rows, axis=0)
    # 1 before the cap, 0 from it on (x * 0.0 = 0.0 for a survival x)
    grid *= prefix_mask(recorded.gamma, caps, np.float64)
    return caps, grid


_prefix_mask_tables: dict[tuple[int, type], np.ndarray] = {}


def prefix_mask(size: int, limits: np.ndarray, dtype: type = np.bool_) -> np.ndarray:
    """``arange(size) < limits[..., None]`` as ``dtype``, from a table (limits below 0 taken as 0, above ``size``
    as ``size``): one gather instead of a broadcast comparison, whose fixed cost is the larger one on a stack of
    small rounds."""
    table = _prefix_mask_tables.get((size, dtype))
    if table is None:
        below = np.arange(size)[None, :] < np.arange(size + 1)[:, None]
        table = _prefix_mask_tables[(size, dtype)] = below.astype(dtype)
    return table.take(limits, axis=0, mode="clip")


def _round_counts(num_requests: np.ndarray, rounds: int, width: int) -> np.ndarray:
    counts = np.asarray(num_requests, dtype=np.int64)
    # (as unsigned, a negative count is above any width: one reduction checks both bounds)
    if counts.shape != (rounds,) or (rounds and not _maximum(counts.view(np.uint64)) <= width):
        raise ValueError(f"num_requests must give 0 <= R <= {width} for each of the {rounds} rounds")
    return counts


def _walk_rounds(
    grid: np.ndarray,
    counts: np.ndarray,
    table_for: Callable[[int], SPSTable],
    draft_cost: DraftCost | None,
    near_ties: bool = True,
    objective: np.ndarray | None = None,
) -> tuple[np.ndarray, list[int]]:
    """The walk of :func:`schedule_lengths_rounds` on survivals ``grid`` [N, R, gamma] (C-contiguous, zero on
    padding). Returns the lengths [N, R] and the rounds to walk alone instead (near ties, too many items). Only
    survivals equal to the last admitted one need the walk's flat index j * R + r. ``near_ties`` False: the grid's
    survivals are known to hold no near tie (:class:`RecordedConfidences`), the check is skipped.

    It walks the negated survivals: sorted ascending they are the walk's order (survivals descending), and
    negation is exact with IEEE rounding symmetric about zero, so tau and Theta come out negated bit for bit,
    every comparison reversed (Theta improves where the negated one decreases)."""
    rounds, width, gamma = grid.shape
    n = gamma * width
    # Column 0 holds -R for the sums of tau, then -infinity (before the walk: nothing admitted); then the walk.
    ranked = np.empty((rounds, n + 1))
    walk = ranked[:, 1:]
    np.negative(grid.reshape(rounds, n), out=walk)
    walk.sort(axis=1)
    alone = _near_ties(walk) if near_ties else None
    if n > _ROUNDS_MAX_ITEMS:
        large = counts * gamma > _ROUNDS_MAX_ITEMS
        alone = large if alone is None else alone | large
    ranked[:, 0] = -counts
    theta = np.add.accumulate(ranked, axis=1)  # -tau_n, sequentially along each round's walk
    ranked[:, 0] = -np.inf
    factors = _round_factors(table_for, draft_cost, width, gamma).take(counts, axis=0)
    if draft_cost is not None:
        np.divide(theta, factors, out=theta)
    else:
        np.multiply(theta, factors, out=theta)
    # Steps that improve Theta; past a round's positive items none does (a zero adds nothing to tau while the
    # price never improves), and a last column of False ends every walk at its last item at the latest. (Compared
    # along the rows laid end to end, one contiguous comparison: that column compared a row's start with the
    # previous row's end.)
    improving = np.empty((rounds, n + 1), dtype=bool)
    along = theta.reshape(-1)
    np.less(along[1:], along[:-1], out=improving.reshape(-1)[:-1])
    improving[:, n] = False
    stop = improving.argmin(axis=1)
    # The admitted items, the first `stop` of the walk: every survival at or above the last admitted one, v,
    # unless more than the walk's own share of survivals equal v (then: of those, the first by flat index).
    at = np.arange(0, rounds * (n + 1), n + 1)
    at += stop
    last = np.negative(ranked.reshape(-1).take(at))[:, None, None]  # v (infinite when none is admitted)
    if objective is not None:  # Theta at the stop (negated)
        np.negative(theta.reshape(-1).take(at), out=objective)
    admitted = grid >= last
    if np.count_nonzero(admitted) != sum(stop.tolist()):
        above = grid > last
        equal = np.ascontiguousarray((grid == last).transpose(0, 2, 1)).reshape(rounds, n)  # by flat index
        left = stop - _add(above.reshape(rounds, n), axis=1)
        first = np.add.accumulate(equal, axis=1) <= left[:, None]
        admitted = above | (equal & first).reshape(rounds, gamma, width).transpose(0, 2, 1)
    lengths = (admitted.view(np.uint8) @ _ONES_U8[:gamma]).astype(np.int64)  # per request: its admitted count
    return lengths, [] if alone is None else np.flatnonzero(alone).tolist()


def _near_ties(walk: np.ndarray) -> np.ndarray | None:
    """Per round, whether two neighbours of its walk (negated survivals, ascending) have float64 bits 1 ..
    _ROUNDS_MAX_ITEMS - 1 apart (negative floats: the bits fall as the values rise); None if no round has."""
    bits = walk.view(np.uint64)
    near = bits[:, :-1] - bits[:, 1:]
    near -= _ONE_BIT
    near_tie = np.less(near, _NEAR_BITS)
    return near_tie.any(axis=1) if np.count_nonzero(near_tie) else None
