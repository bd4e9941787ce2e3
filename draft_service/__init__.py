"""The DSpark drafter service.

Holds the draft model (a parallel backbone conditioned on target context features injected as extra keys and
values, followed by a light sequential head: Markov, gated Markov or RNN, plus a confidence head), loading of
DeepSpec-format checkpoints, the draft engine that proposes blocks for many requests in one batched pass while
keeping a per-request context-feature cache, and the thin Ray Serve / gRPC adapters around that engine.
"""
