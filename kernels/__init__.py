"""Triton kernels with pure-torch references of the same signature.

Rejection sampling over ragged draft blocks (full or sparse draft distributions, per-request temperature,
top-k and top-p, greedy and sampled requests mixed) and fused Markov-head sampling. Every kernel has a torch
reference used on machines without Triton support and as the oracle in tests; on CPU the Triton versions run
through ``TRITON_INTERPRET=1``.
"""
