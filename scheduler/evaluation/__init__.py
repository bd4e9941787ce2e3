"""Offline evaluation of drafters (``dspark eval``), outside the serving import graph.

``reference_loop`` is the plain (unbatched, uncached-by-slot) speculative loop over a target and a drafter that the
evaluation, the drafter training and the tests share; ``decoder`` decodes prompt files with full-block
verification and keeps per-round traces; ``report`` turns the traces into the paper's tables and figures.
"""
