"""The verifier service: the target model.

Wraps a Qwen3-family target built with transformers so that it returns logits plus the hidden states of the
layers the drafter consumes (context features), manages the KV cache of many requests verifying ragged
numbers of draft tokens per round, applies lossless rejection sampling and rolls rejected entries back. The
Ray Serve deployment and gRPC servicer are thin adapters over the verify engine.
"""
