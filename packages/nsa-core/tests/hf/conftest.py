"""The Hugging Face tests need nsa-core's ``hf`` extra. The CPU tiers install it (noxfile.py,
the README's commands) and run every test here; a GPU host's tiers run from a checkout with the
GPU's own torch and without transformers, and collect these files only where it is installed
(the reference tier, which holds them, is a CPU tier)."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("transformers") is None:
    collect_ignore_glob = ["test_hf_[!i]*.py"]
