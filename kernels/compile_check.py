"""Compile every Triton kernel configuration for a GPU architecture, without a GPU.

Why: tests on CPU run the kernels through Triton's interpreter, which accepts programs the real compiler
rejects (for example a loop-carried variable that changes from int32 to int64). ``triton.compile`` with an
explicit target runs the real front end, LLVM and ptxas from the Triton wheel, so a machine without a GPU
(CI, the dev box) can still prove that the kernels build for the GPUs we serve on.

    python -m kernels.compile_check            # sm_90 (H100/H200)
    python -m kernels.compile_check --arch 80  # A100

Must run with TRITON_INTERPRET unset (the kernels are decorated at import time); the module refuses otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from kernels.launch import interpreting

_REJECTION_COMMON = dict(logits_ptr="*bf16", stride_row="i64", cu_ptr="*i64", temperature_ptr="*fp32",
                         seeds_ptr="*i64", positions_ptr="*i64", zmax_ptr="*fp32", norm_ptr="*fp32",
                         tau_ptr="*fp32", num_acc_ptr="*i64", probs_ptr="*fp32", stride_probs="i32",
                         prob_ids_ptr="*i64", K="i32", V="i32", row_req_ptr="*i32", top_k_ptr="*i64",
                         top_p_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", part_arg_ptr="*i32",
                         sketch_ptr="*fp32", split_size="i32", num_splits="i32", argmax_ptr="*i32",
                         state_ptr="*i32", cand_ptr="*i64",
                         draft_ids_ptr="*i64", out_ptr="*i64", mass_ptr="*fp32", emass_ptr="*fp32",
                         num_blocks="i32", group="i32", num_req="i32", listed_ptr="*i32",
                         num_words="i32", hits_ptr="*i32")  # fmt: skip
_MARKOV_COMMON = dict(base_ptr="*bf16", stride_br="i64", stride_bk="i64", step="i32", prev_ptr="*i64",
                      stride_prev="i32", w1_ptr="*bf16", w2_ptr="*bf16", temperature_ptr="*fp32",
                      seeds_ptr="*i64", positions_ptr="*i64", k_eff_ptr="*i32", logits_ptr="*fp32", z_ptr="*fp32",
                      stride_lr="i64", stride_lk="i64", part_f_ptr="*fp32", part_i_ptr="*i64", cand_ptr="*i64",
                      tiles_ptr="*i32", buffer_ptr="*i64", tokens_ptr="*i64", probs_ptr="*fp32",
                      sparse_ids_ptr="*i64", sparse_probs_ptr="*fp32", R="i32", V="i32", RANK="i32",
                      num_chunks="i32", K="i32", gamma="i32")  # fmt: skip
_SIGNATURES = {name: _REJECTION_COMMON for name in ("_row_stats_kernel", "_row_combine_kernel", "_accept_chain_kernel",
               "_cdf_mass_kernel", "_cdf_draw_kernel")}  # fmt: skip
_SIGNATURES.update({name: _MARKOV_COMMON for name in ("_markov_step_kernel", "_markov_combine_kernel")})
# (kernel, constexprs, num_warps): the configurations the launchers use at production vocabulary sizes
_CONFIGS = [
    ("_row_stats_kernel", dict(BLOCK_V=2048, NG=128), 4),
    ("_row_combine_kernel", dict(BLOCK_SPLITS=16, BLOCK_SKETCH=512, NG=128, CAP=2048, SMALL=256, TINY=64,
                                 BLOCK_S=512, NCAND=16, BLOCK_V=2048, W=16, CHUNKS=512, HIT_CHUNKS=16, CDF_BLOCK=2048,
                                 NW=4),
     4),
    *[("_accept_chain_kernel", dict(PROBS=mode, BLOCK_K=64), 1) for mode in (0, 1, 2)],
    *[("_cdf_mass_kernel", dict(PROBS=mode, BLOCK_V=2048, BLOCK_K=64, GROUP=4), 4) for mode in (0, 1, 2)],
    *[("_cdf_draw_kernel", dict(PROBS=mode, BLOCK_V=2048, BLOCK_NB=128, BLOCK_K=64), 4) for mode in (0, 1, 2)],
    ("_markov_step_kernel", dict(BLOCK_R=32, BLOCK_V=128, BLOCK_D=64, TOPK=0, STORE_LOGITS=False,
                                 NATIVE_DOT=True), 8),
    ("_markov_step_kernel", dict(BLOCK_R=32, BLOCK_V=256, BLOCK_D=64, TOPK=64, STORE_LOGITS=True,
                                 NATIVE_DOT=True), 8),
    ("_markov_step_kernel", dict(BLOCK_R=16, BLOCK_V=64, BLOCK_D=64, TOPK=16, STORE_LOGITS=True,
                                 NATIVE_DOT=True), 8),  # an inflated pair's 4096 real ids, K = 16
    ("_markov_combine_kernel", dict(TOPK=0, BLOCK_C=2048, TILE_V=128, TILE_GROUP=16, CAPM=256), 4),
    ("_markov_combine_kernel", dict(TOPK=16, BLOCK_C=64, TILE_V=64, TILE_GROUP=16, CAPM=256), 4),
    ("_markov_combine_kernel", dict(TOPK=64, BLOCK_C=1024, TILE_V=256, TILE_GROUP=16, CAPM=256), 4),
]  # fmt: skip


def _skinny_signature(dtype: str, split: bool) -> dict[str, str]:
    """The skinny GEMM's argument types: without a split the partial and counter pointers are the output's."""
    return dict(x_ptr=f"*{dtype}", w_ptr=f"*{dtype}", y_ptr=f"*{dtype}", part_ptr="*fp32" if split else f"*{dtype}",
                count_ptr="*i32" if split else f"*{dtype}", M="i32", N="i32", K="i32", stride_xm="i32",
                stride_wn="i32", stride_ym="i32", up_offset="i32", blocks_per_split="i32",
                num_m_tiles="i32")  # fmt: skip


def _skinny(block_m: int, split: int, gated: bool = False, residual: bool = False, even: bool = True,
            dtype: str = "bf16", block_n: int = 64, block_k: int = 128, warps: int = 4, stages: int = 4,
            tma: bool = False):  # fmt: skip
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, GATED=gated, RESIDUAL=residual,
                      EVEN=even, NATIVE_DOT=dtype != "fp32", TMA=tma)  # fmt: skip
    types = _skinny_signature(dtype, split > 1)
    aligned = _SKINNY_ALIGNED
    if tma:  # W as a host tensor descriptor with [BLOCK_N, BLOCK_K] blocks
        types["w_ptr"] = f"tensordesc<{dtype}[{block_n}, {block_k}]>"
        aligned = tuple(arg for arg in aligned if arg != "w_ptr")
    return ("_skinny_gemm_kernel", constexprs, warps, stages, types, aligned)


# Arguments the launcher specialises as multiples of 16 (aligned pointers; the Qwen3 shapes' N, K and strides):
# the W and x loads are vectorised and pipelined only with that knowledge, as they are at run time.
_SKINNY_ALIGNED: tuple[str, ...] = ("x_ptr", "w_ptr", "y_ptr", "part_ptr", "count_ptr", "N", "K", "stride_xm",
                                    "stride_wn", "stride_ym", "up_offset")  # fmt: skip


# (kernel, constexprs, num_warps, num_stages, signature, 16-divisible arguments) of kernels/skinny_gemm_triton.py:
# the Qwen3-4B shapes' default launches (QKV / gate_up split 4-5, o_proj / down_proj with the residual add split
# 6-13), the sweep's extremes (no split; 256-wide K steps; 8 warps, 3 stages), W by TMA, and a float32 model's
# IEEE dot
_SKINNY_CONFIGS = [
    _skinny(16, 5), _skinny(64, 4), _skinny(16, 1, block_k=256), _skinny(64, 1, warps=8, stages=3),
    _skinny(16, 13, residual=True), _skinny(64, 6, residual=True), _skinny(16, 1, residual=True, block_n=32),
    _skinny(16, 5, gated=True), _skinny(64, 2, gated=True), _skinny(32, 1, gated=True, even=False),
    _skinny(16, 5, tma=True), _skinny(16, 13, residual=True, tma=True), _skinny(64, 2, gated=True, tma=True),
    _skinny(16, 2, dtype="fp32", even=False, block_k=64), _skinny(64, 1, gated=True, dtype="fp32", even=False,
                                                                 block_k=64),
]  # fmt: skip


def compile_all(arch: int) -> list[str]:
    """Compile every configuration for ``sm_<arch>`` (raises on the first failure); one line per kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import markov_triton, rejection_triton, skinny_gemm_triton

    target = GPUTarget("cuda", arch, 32)
    runs = [(name, constexprs, warps, 3, _SIGNATURES[name], ()) for name, constexprs, warps in _CONFIGS]
    lines = []
    for name, constexprs, num_warps, num_stages, types, aligned in runs + _SKINNY_CONFIGS:
        fn = next(getattr(m, name) for m in (rejection_triton, markov_triton, skinny_gemm_triton) if hasattr(m, name))
        if "PDL" in fn.arg_names:  # programmatic dependent launch: the Hopper instructions where the launch uses it
            constexprs = {**constexprs, "PDL": arch >= 90}
        signature = {arg: "constexpr" if arg in constexprs else types[arg] for arg in fn.arg_names}
        attrs = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in aligned}
        start = time.perf_counter()
        triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=target,
            options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": False},
        )
        lines.append(f"{name} {constexprs} warps={num_warps} stages={num_stages}: "
                     f"ok in {time.perf_counter() - start:.1f}s")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 or 80")
    args = parser.parse_args()
    if interpreting():
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels that must be compiled")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
    for line in compile_all(args.arch):
        print(line, flush=True)


if __name__ == "__main__":
    main()
