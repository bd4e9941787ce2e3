"""Input checks shared by the samplers: every malformed input becomes a ValueError before any launch."""

from __future__ import annotations

import torch

from kernels.rng import MAX_POSITION

MAX_SPARSE_K = 1024
"""Widest sparse draft distribution (ids, probs) per position: kernels hold one such row in registers."""

MIN_TEMPERATURE = 1e-5
"""Smallest positive temperature; below it logits / T overflows float32 for ordinary logits (0 = greedy)."""


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless ``condition``."""
    if not condition:
        raise ValueError(message)


def check_vector(name: str, tensor: object, length: int, integer: bool, device: torch.device) -> None:
    """``tensor`` must be a 1-D tensor of ``length`` integer (or floating) entries on ``device``."""
    require(isinstance(tensor, torch.Tensor), f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    assert isinstance(tensor, torch.Tensor)
    require(
        tensor.dim() == 1 and tensor.shape[0] == length,
        f"{name} must have shape [{length}], got {list(tensor.shape)}",
    )
    if integer:
        require(
            not tensor.dtype.is_floating_point and tensor.dtype != torch.bool,
            f"{name} must be an integer tensor, got {tensor.dtype}",
        )
    else:
        require(tensor.dtype.is_floating_point, f"{name} must be a floating tensor, got {tensor.dtype}")
    require(tensor.device == device, f"{name} is on {tensor.device}, expected {device}")


def check_request_params(
    temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, device: torch.device
) -> int:
    """Check the per-request temperature / seed / anchor position vectors; returns R."""
    require(
        isinstance(temperature, torch.Tensor) and temperature.dim() == 1, "temperature must have shape [R]"
    )
    num_req = temperature.shape[0]
    check_vector("temperature", temperature, num_req, False, device)
    check_vector("seeds", seeds, num_req, True, device)
    check_vector("positions", positions, num_req, True, device)
    require(bool(torch.isfinite(temperature).all()), "temperature must be finite")
    require(bool((temperature >= 0).all()), "temperature must be >= 0 (0 means greedy)")
    require(
        bool(((temperature == 0) | (temperature >= MIN_TEMPERATURE)).all()),
        f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}",
    )
    require(
        bool(((positions >= 0) & (positions <= MAX_POSITION - 1)).all()),
        f"positions must be in [0, {MAX_POSITION - 1}]",
    )
    return num_req
