"""The drafter's context projection as a module of its own, so that the verifier can apply it before shipping.

A drafter turns the concatenated hidden states of the target's m chosen layers (one row of width m*H per committed
token) into one projected context row ``hidden_norm(fc(row))`` of width H, and only that row ever enters its
context cache. Applying this on the verifier side therefore sends 1/m of the feature bytes over the wire and
changes nothing else: the drafter appends the already-projected rows (``append_context(..., projected=True)``).

Both sides must use the same weights, or the drafter would silently draft from wrong context (lossless still, the
verifier decides every token, but acceptance would collapse). So a projection has a :attr:`fingerprint` (a hash of
its weights as used: dtype, shapes and bytes of ``fc.weight`` and ``hidden_norm.weight``, and the norm's eps); a
verifier stamps every projected feature message with it and a drafter refuses rows projected by anything but its
own weights (``INVALID_ARGUMENT``). The computation is exactly :meth:`DSparkDraftModel.project_context` (same
modules, same op order), so rows projected on either side are bit-identical for the same batch of rows on the same
kind of device and dtype.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from draft_service.checkpoint import CONFIG_NAME, SUPPORTED_DTYPES, read_safetensors_folder
from draft_service.config import CheckpointError, DraftConfig
from draft_service.model import DSparkDraftModel
from kernels.rms_norm import RMSNorm

#: The checkpoint tensors a verifier needs (DeepSpec's names): nothing else of the drafter is read.
PROJECTION_TENSORS = ("fc.weight", "hidden_norm.weight")


def projection_fingerprint(fc_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> str:
    """A short hash naming a projection's weights exactly as they are used (dtype included)."""
    digest = hashlib.sha256(f"{eps!r}".encode())
    for weight in (fc_weight, norm_weight):
        w = weight.detach().to("cpu").contiguous()
        digest.update(f"{w.dtype}{tuple(w.shape)}".encode())
        digest.update(w.view(torch.uint8).numpy().tobytes() if w.numel() else b"")
    return digest.hexdigest()[:16]


def model_fingerprint(model: DSparkDraftModel) -> str:
    """The fingerprint of a loaded drafter's own projection (what its context cache expects)."""
    return projection_fingerprint(model.fc.weight, model.hidden_norm.weight, model.hidden_norm.variance_epsilon)


class ContextProjection(nn.Module):
    """``hidden_norm(fc(features))``: context features [..., m*H] -> projected context [..., H] (drafter dtype)."""

    def __init__(self, feature_size: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.fc = nn.Linear(feature_size, hidden_size, bias=False)
        self.hidden_norm = RMSNorm(hidden_size, eps)
        self._fingerprint: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def feature_size(self) -> int:
        return self.fc.in_features

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            norm = self.hidden_norm
            self._fingerprint = projection_fingerprint(self.fc.weight, norm.weight, norm.variance_epsilon)
        return self._fingerprint

    @torch.no_grad()
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if features.shape[-1] != self.feature_size:
            raise ValueError(f"context features have width {features.shape[-1]}, expected m*H = {self.feature_size}")
        # The op order of DSparkDraftModel.project_context, so that both sides give the same bits.
        return self.hidden_norm(self.fc(features.to(self.dtype)))


def load_context_projection(
    draft_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> ContextProjection:
    """Read only ``fc`` and ``hidden_norm`` of a DeepSpec-layout drafter checkpoint, converted to ``dtype`` (use
    the drafter replicas' dtype: the fingerprint covers it, and a different one is refused by the drafters)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {SUPPORTED_DTYPES}")
    draft_dir = Path(draft_dir)
    config = DraftConfig.from_json(draft_dir / CONFIG_NAME)
    tensors, source = read_safetensors_folder(draft_dir, list(PROJECTION_TENSORS))
    projection = ContextProjection(config.context_feature_size, config.hidden_size, config.rms_norm_eps)
    expected = projection.state_dict()
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                str(source), name, f"shape {tuple(tensor.shape)} does not match {tuple(expected[name].shape)}"
            )
    state = {name: tensor.to(device=device, dtype=dtype) for name, tensor in tensors.items()}
    projection.load_state_dict(state, strict=True, assign=True)
    projection.requires_grad_(False)
    return projection.eval()
