#!/usr/bin/env python3
"""GPU robustness of the Triton kernels: the entry point of the ``ci/robustness`` package, whose
docstring says what each part checks (``python ci/gpu_robustness.py --help`` lists the parts)."""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # ci/ is a folder of scripts, not an installed package: make ``ci.robustness`` importable
    # when this file runs as a script.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ci.robustness.cli import main

    sys.exit(main())
