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
                         prob_ids_ptr="*i64", K="i32", V="i32")  # fmt: skip
_SIGNATURES = {
    "_row_stats_kernel": dict(_REJECTION_COMMON, row_req_ptr="*i32", top_k_ptr="*i64", top_p_ptr="*fp32",
                              argmax_ptr="*i32"),
    "_accept_chain_kernel": dict(_REJECTION_COMMON, draft_ids_ptr="*i64", argmax_ptr="*i32", out_ptr="*i64"),
    "_race_kernel": dict(_REJECTION_COMMON, part_ptr="*i64", split_size="i32", num_splits="i32"),
    "_finalize_kernel": dict(part_ptr="*i64", cu_ptr="*i64", temperature_ptr="*fp32", num_acc_ptr="*i64",
                             out_ptr="*i64", num_splits="i32"),
    "_markov_step_kernel": dict(base_ptr="*bf16", stride_br="i64", stride_bk="i64", step="i32",
                                prev_ptr="*i64", stride_prev="i32", w1_ptr="*bf16", w2_ptr="*bf16",
                                temperature_ptr="*fp32", seeds_ptr="*i64", positions_ptr="*i64",
                                logits_ptr="*fp32", stride_lr="i64", stride_lk="i64", part_f_ptr="*fp32",
                                part_i_ptr="*i32", cand_ptr="*i64", R="i32", V="i32", RANK="i32",
                                num_chunks="i32", K="i32"),
    "_markov_combine_kernel": dict(part_f_ptr="*fp32", part_i_ptr="*i32", cand_ptr="*i64", step="i32",
                                   temperature_ptr="*fp32", seeds_ptr="*i64", positions_ptr="*i64",
                                   tokens_ptr="*i64", probs_ptr="*fp32", sparse_ids_ptr="*i64",
                                   sparse_probs_ptr="*fp32", gamma="i32", num_chunks="i32", K="i32"),
}  # fmt: skip
# (kernel, constexprs, num_warps): the configurations the launchers use at production vocabulary sizes
_CONFIGS = [
    ("_row_stats_kernel", dict(BLOCK_V=4096, BLOCK_S=512, NCAND=16), 8),
    *[("_accept_chain_kernel", dict(PROBS=mode, BLOCK_K=64), 1) for mode in (0, 1, 2)],
    *[("_race_kernel", dict(PROBS=mode, BLOCK_V=2048, BLOCK_K=64), 8) for mode in (0, 1, 2)],
    ("_finalize_kernel", dict(BLOCK_SPLITS=16), 1),
    ("_markov_step_kernel", dict(BLOCK_R=32, BLOCK_V=128, BLOCK_D=64, TOPK=0, STORE_LOGITS=False,
                                 NATIVE_DOT=True), 8),
    ("_markov_step_kernel", dict(BLOCK_R=16, BLOCK_V=256, BLOCK_D=64, TOPK=64, STORE_LOGITS=True,
                                 NATIVE_DOT=False), 8),
    *[("_markov_combine_kernel", dict(TOPK=topk, BLOCK_C=1024), 4) for topk in (0, 64)],
]  # fmt: skip


def compile_all(arch: int) -> list[str]:
    """Compile every configuration for ``sm_<arch>`` (raises on the first failure); one line per kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import markov_triton, rejection_triton

    target = GPUTarget("cuda", arch, 32)
    lines = []
    for name, constexprs, num_warps in _CONFIGS:
        fn = getattr(rejection_triton, name, None) or getattr(markov_triton, name)
        signature = {
            arg: "constexpr" if arg in constexprs else _SIGNATURES[name][arg] for arg in fn.arg_names
        }
        start = time.perf_counter()
        triton.compile(
            ASTSource(fn, signature, constexprs),
            target=target,
            options={"num_warps": num_warps, "enable_fp_fusion": False},
        )
        lines.append(f"{name} {constexprs} warps={num_warps}: ok in {time.perf_counter() - start:.1f}s")
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
