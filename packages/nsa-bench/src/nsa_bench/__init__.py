"""Benches, environment metadata and the GPU-host runner for nsa."""

__version__ = "0.1.0"
