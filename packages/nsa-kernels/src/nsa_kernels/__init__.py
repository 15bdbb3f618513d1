"""GPU kernels for Native Sparse Attention, registered as nsa-core backends."""

__version__ = "0.1.0"
