"""Programmatic dependent launch (kernels.launch.pdl_options): off where it cannot run, and on a Hopper GPU a
captured chain of dependent kernels gives bit for bit what the same chain gives without it."""

from __future__ import annotations

import pytest
import torch

from kernels.launch import PDL_MAX_ROWS, pdl_options


def test_pdl_is_off_on_the_cpu_and_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl_options(torch.device("cpu"), 8) == {"PDL": False}
    monkeypatch.setenv("DSPARK_PDL", "0")
    assert pdl_options(torch.device("cpu"), 8) == {"PDL": False}


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs a Hopper GPU"
)
def test_a_captured_chain_of_dependent_kernels_is_the_same_with_and_without_pdl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each kernel reads what the one before wrote (norm -> GEMM with the residual add in place -> norm -> gated
    GEMM -> GEMM -> ...), 12 times over, replayed as one CUDA graph: a kernel that started reading before its
    predecessor finished would change the result."""
    from kernels.fused_layer_triton import add_rms_norm, silu_mul
    from kernels.skinny_gemm_triton import new_counters, skinny_gate_up_silu, skinny_linear

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, inter = 1024, 2816

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)

    layers = [(weight(hidden, hidden), weight(2 * inter, hidden), weight(hidden, inter)) for _ in range(12)]
    norm = torch.rand(hidden, generator=gen, device=device).to(torch.bfloat16) + 0.5
    start = torch.randn(8, hidden, generator=gen, device=device).to(torch.bfloat16)

    def run(pdl: str) -> torch.Tensor:
        monkeypatch.setenv("DSPARK_PDL", pdl)
        counters = new_counters(device)
        x = start.clone()

        def chain() -> None:
            for proj, gate_up, down in layers:
                skinny_linear(add_rms_norm(x, None, norm, 1e-6), proj, x, counters=counters)
                act = skinny_gate_up_silu(add_rms_norm(x, None, norm, 1e-6), gate_up, counters=counters)
                skinny_linear(silu_mul(torch.cat([act, act], dim=1)), down, x, counters=counters)

        chain()  # compile outside the capture
        x.copy_(start)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        x.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        return x.clone()

    monkeypatch.setenv("DSPARK_PDL", "1")
    assert pdl_options(device, 8) == {"PDL": True, "launch_pdl": True}
    assert pdl_options(device, PDL_MAX_ROWS + 1) == {"PDL": False}  # larger passes: measured slower with it
    with_pdl, without = run("1"), run("0")
    assert torch.isfinite(without).all()
    assert torch.equal(with_pdl, without)
