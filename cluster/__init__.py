"""Cluster-wide plumbing for dspark-serve.

Everything that is shared by the drafter, the verifier and the scheduler but belongs to none of them lives
here: the configuration model, the gRPC + msgpack wire contract (tensors as raw bytes + dtype + shape, never
pickle), Ray bootstrap (an embedded local cluster, or joining an existing one, with the drafter and verifier
pools expressed as Ray custom resources), assembly of the Ray Serve application, and the ``dspark`` CLI.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dspark-serve")
except PackageNotFoundError:  # running from a source checkout that was never installed
    __version__ = "0.0.0+source"
