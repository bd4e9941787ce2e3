"""Triton kernels with pure-torch references of the same signature.

Rejection sampling over ragged draft blocks (full or sparse draft distributions, per-request temperature,
top-k and top-p, greedy and sampled requests mixed), varlen attention over slot KV caches (the target's
verify and prefill chunks, the drafter's block over its context) and fused Markov-head sampling; the samplers
draw their random numbers from one counter-based RNG (:mod:`kernels.rng`) so that a request's output depends
only on its seed and positions. Every kernel has a torch reference used on machines without Triton support and
as the oracle in tests; on CPU the Triton versions run through ``TRITON_INTERPRET=1``.

``kernels.dispatch``'s ``rejection_sample``, ``slot_attention`` and ``markov_sample`` pick the Triton kernel for
CUDA tensors and the torch reference otherwise (the interpreter is for tests, far too slow to serve with).

Modules: ``rng`` / ``rng_triton`` (counter-based uniforms), ``float_keys`` / ``float_keys_triton`` (exact order
keys of floats; the torch halves import without Triton, which the scheduler process never loads), ``checks`` (input
validation shared by the samplers), ``rejection`` / ``rejection_triton`` (verification), ``markov`` /
``markov_triton`` (drafting), ``slot_attention`` / ``slot_attention_triton`` (attention over slot caches),
``launch`` (launch options), ``sampling`` (per-request sampling parameters), ``graphs`` (CUDA-graph buckets and
captured steps), ``slot_lookups`` (kept slot lookups), ``compile_check`` (``python -m kernels.compile_check``:
compiles every kernel for a GPU architecture on a machine without a GPU).

This file imports nothing, so the light modules (``sampling``) load without torch (``dspark --help`` stays fast).
"""
