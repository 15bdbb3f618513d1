"""Build the CUDA selection kernel on demand with ``torch.utils.cpp_extension.load``.

Nothing is compiled at install time: the first call builds ``csrc/`` for the GPU that is present
(one ``-gencode`` for its compute capability) into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and later calls reuse it.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("sel_fwd_binding.cpp", "sel_fwd.cu")

_extensions: dict[str, ModuleType] = {}


def build_unavailable_reason() -> str | None:
    """Why the extension cannot be built or run here, or None."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "needs the CUDA toolkit: nvcc is not on PATH and CUDA_HOME is not set"
    if not cpp_extension.is_ninja_available():
        return "needs ninja to build the extension (pip install ninja)"
    return None


def load_extension(verbose: bool = False) -> ModuleType:
    """The compiled extension for the current GPU (built on the first call).

    Raises RuntimeError naming what is missing when there is no GPU, nvcc or ninja.
    """
    reason = build_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the cuda_sel kernel cannot be built: {reason}")
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    if arch not in _extensions:
        from torch.utils import cpp_extension

        _extensions[arch] = cpp_extension.load(
            name=f"nsa_cuda_sel_sm{arch}",
            sources=[str(CSRC / name) for name in SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=[
                "-O3",
                "-lineinfo",
                f"-gencode=arch=compute_{arch},code=sm_{arch}",
            ],
            verbose=verbose,
        )
    return _extensions[arch]
