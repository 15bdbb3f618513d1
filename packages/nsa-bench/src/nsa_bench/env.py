"""Environment metadata that every bench row and runner report carries.

:func:`collect` returns one flat ``dict[str, str]`` (so the same keys become CSV columns and JSON
fields):

| key | value | when it cannot be had |
|---|---|---|
| hostname | ``socket.gethostname()`` | |
| gpu_name | name of GPU 0 (``nvidia-smi``; else torch's device name) | ``none`` (no GPU) |
| gpu_count | number of GPUs nvidia-smi lists (else torch's count) | ``0`` |
| gpu_driver | NVIDIA driver version (``nvidia-smi``) | ``none`` (no nvidia-smi) |
| gpu_capability | compute capability of GPU 0 as torch sees it, ``sm_90`` | ``none`` |
| torch, cuda | ``torch.__version__``, ``torch.version.cuda`` | ``none`` |
| triton | ``triton.__version__`` | ``none`` |
| python | ``platform.python_version()`` | |
| commit | ``git rev-parse --short HEAD``, ``-dirty`` if tracked files changed | ``unknown`` |
| pairing | verdict of :func:`nsa_kernels.pairing.installed_pairing` | |
| triton_expected | the triton pin of torch's minor in the version table | ``none`` |
| timestamp_utc | ISO 8601 in UTC, ``2026-11-22T04:38:00Z`` | |

``none`` means the thing is absent; ``unknown`` means it is there but could not be read (a
failing ``nvidia-smi``, a folder that is not a git checkout). Nothing here raises on a CPU-only
machine.
"""

from __future__ import annotations

import datetime as _dt
import platform
import shutil
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

from nsa_kernels.pairing import installed_pairing

NONE = "none"
UNKNOWN = "unknown"

FIELDS = (
    "hostname",
    "gpu_name",
    "gpu_count",
    "gpu_driver",
    "gpu_capability",
    "torch",
    "cuda",
    "triton",
    "python",
    "commit",
    "pairing",
    "triton_expected",
    "timestamp_utc",
)

_TIMEOUT_S = 20


def _run(cmd: Sequence[str], cwd: str | Path | None = None) -> str | None:
    """stdout of ``cmd``, or None when it cannot be run, fails, or hangs."""
    try:
        proc = subprocess.run(
            list(cmd), cwd=cwd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def nvidia_smi_info(nvidia_smi: str | None) -> dict[str, str]:
    """``gpu_name``, ``gpu_count``, ``gpu_driver`` from nvidia-smi at path ``nvidia_smi``.

    None (not on PATH): no NVIDIA GPU here, every field ``none`` / ``0``. A failing or unreadable
    nvidia-smi gives ``unknown``.
    """
    if nvidia_smi is None:
        return {"gpu_name": NONE, "gpu_count": "0", "gpu_driver": NONE}
    out = _run([nvidia_smi, "--query-gpu=name,driver_version", "--format=csv,noheader"])
    rows = [line.split(",") for line in (out or "").splitlines() if line.strip()]
    if not rows or any(len(row) != 2 for row in rows):
        return {"gpu_name": UNKNOWN, "gpu_count": UNKNOWN, "gpu_driver": UNKNOWN}
    return {
        "gpu_name": rows[0][0].strip(),
        "gpu_count": str(len(rows)),
        "gpu_driver": rows[0][1].strip(),
    }


def torch_info() -> dict[str, str]:
    """``torch``, ``cuda`` and what torch sees of GPU 0 (name, count, capability)."""
    try:
        import torch
    except Exception:  # a broken install raises more than ImportError
        return {"torch": NONE, "cuda": NONE, "gpu_capability": NONE}
    info = {"torch": str(torch.__version__), "cuda": torch.version.cuda or NONE}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        info["gpu_capability"] = f"sm_{major}{minor}"
        info["torch_gpu_name"] = torch.cuda.get_device_name(0)
        info["torch_gpu_count"] = str(torch.cuda.device_count())
    else:
        info["gpu_capability"] = NONE
    return info


def git_commit(repo: str | Path) -> str:
    """Short hash of HEAD in ``repo``, with ``-dirty`` if tracked files differ; else ``unknown``.

    ``unknown`` too where ``repo`` holds no file the checkout above it tracks: a copy of the tree
    placed in an ignored folder of another checkout would otherwise record that one's commit.
    """
    git = shutil.which("git")
    if git is None:
        return UNKNOWN
    head = _run([git, "rev-parse", "--short", "HEAD"], cwd=repo)
    if not head or not _run([git, "ls-files", "--error-unmatch", "."], cwd=repo):
        return UNKNOWN
    status = _run([git, "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    dirty = "-dirty" if status else ""
    return head.strip() + dirty


def utc_timestamp(now: _dt.datetime | None = None) -> str:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return now.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def collect(repo: str | Path | None = None, nvidia_smi: str | None = "") -> dict[str, str]:
    """Every field of :data:`FIELDS` for this machine and interpreter, as strings.

    ``repo`` is the git checkout whose commit is recorded (default: the working directory).
    ``nvidia_smi`` is the nvidia-smi executable ("" finds it on PATH, None means there is none).
    """
    if nvidia_smi == "":
        nvidia_smi = shutil.which("nvidia-smi")
    gpu = nvidia_smi_info(nvidia_smi)
    tinfo = torch_info()
    # Without nvidia-smi (a container without it, or a non-NVIDIA build) torch's view is the best
    # there is for the name and count; the driver stays absent.
    if gpu["gpu_name"] == NONE and "torch_gpu_name" in tinfo:
        gpu["gpu_name"] = tinfo["torch_gpu_name"]
        gpu["gpu_count"] = tinfo["torch_gpu_count"]
    verdict = installed_pairing()
    row = {
        "hostname": socket.gethostname(),
        **gpu,
        "gpu_capability": tinfo["gpu_capability"],
        "torch": tinfo["torch"],
        "cuda": tinfo["cuda"],
        "triton": verdict.triton or NONE,
        "python": platform.python_version(),
        "commit": git_commit(repo if repo is not None else Path.cwd()),
        "pairing": verdict.verdict,
        "triton_expected": verdict.expected or NONE,
        "timestamp_utc": utc_timestamp(),
    }
    return {key: row[key] for key in FIELDS}


def collect_columns() -> dict[str, str]:
    """:func:`collect` with every key as the benches' CSV column ``env_<key>``."""
    return {f"env_{key}": value for key, value in collect().items()}
