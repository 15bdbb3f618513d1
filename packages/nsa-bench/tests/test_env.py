"""Environment metadata: every field present, strings only, robust without a GPU."""

from __future__ import annotations

import datetime as dt
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nsa_bench import env
from nsa_kernels.pairing import installed_pairing


def _fake_nvidia_smi(tmp_path: Path, stdout: str, code: int = 0) -> str:
    """An executable that prints ``stdout`` and exits with ``code``, standing in for nvidia-smi."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nsys.stdout.write({stdout!r})\nsys.exit({code})\n"
    )
    script.chmod(0o755)
    return str(script)


def test_collect_without_nvidia_smi_has_every_field() -> None:
    row = env.collect(nvidia_smi=None)
    assert tuple(row) == env.FIELDS
    assert all(isinstance(v, str) and v for v in row.values()), row
    assert row["gpu_driver"] == "none"
    import torch

    if not torch.cuda.is_available():
        assert (row["gpu_name"], row["gpu_count"], row["gpu_capability"]) == ("none", "0", "none")
    assert row["torch"] == str(torch.__version__)
    assert row["cuda"] == (torch.version.cuda or "none")
    assert row["python"] == platform.python_version()
    verdict = installed_pairing()
    assert row["pairing"] == verdict.verdict
    assert row["triton"] == (verdict.triton or "none")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", row["timestamp_utc"])
    stamp = dt.datetime.strptime(row["timestamp_utc"], "%Y-%m-%dT%H:%M:%SZ")
    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    assert abs((now - stamp).total_seconds()) < 120


def test_collect_finds_nvidia_smi_on_path() -> None:
    row = env.collect()
    if shutil.which("nvidia-smi") is None:
        assert row["gpu_driver"] == "none"
    else:
        assert row["gpu_driver"] not in ("none", "")


def test_nvidia_smi_rows_are_parsed(tmp_path: Path) -> None:
    smi = _fake_nvidia_smi(
        tmp_path, "NVIDIA H100 80GB HBM3, 580.65.06\nNVIDIA H100 80GB HBM3, 580.65.06\n"
    )
    info = env.nvidia_smi_info(smi)
    assert info == {
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "gpu_count": "2",
        "gpu_driver": "580.65.06",
    }
    row = env.collect(nvidia_smi=smi)
    assert (row["gpu_name"], row["gpu_count"], row["gpu_driver"]) == (
        "NVIDIA H100 80GB HBM3",
        "2",
        "580.65.06",
    )


@pytest.mark.parametrize(
    ("stdout", "code"),
    [
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", 9),
        ("", 0),
        ("garbage without a comma\n", 0),
    ],
)
def test_failing_nvidia_smi_is_unknown(tmp_path: Path, stdout: str, code: int) -> None:
    info = env.nvidia_smi_info(_fake_nvidia_smi(tmp_path, stdout, code))
    assert info == {"gpu_name": "unknown", "gpu_count": "unknown", "gpu_driver": "unknown"}


def test_missing_nvidia_smi_executable_is_unknown(tmp_path: Path) -> None:
    info = env.nvidia_smi_info(str(tmp_path / "does-not-exist"))
    assert info["gpu_name"] == "unknown"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_git_commit(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("needs git on PATH")
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "f.txt").write_text("a\n")
    _git(repo, "add", "f.txt")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "m")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert env.git_commit(repo) == head
    assert env.collect(repo=repo, nvidia_smi=None)["commit"] == head
    (repo / "f.txt").write_text("b\n")
    assert env.git_commit(repo) == head + "-dirty"
    (repo / "untracked.txt").write_text("c\n")
    (repo / "f.txt").write_text("a\n")
    assert env.git_commit(repo) == head  # untracked files do not make a build dirty


def test_git_commit_of_a_copy_in_an_ignored_folder_is_unknown(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("needs git on PATH")
    repo = tmp_path / "repo"
    (repo / "copy").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("copy/\n")
    (repo / "copy" / "f.txt").write_text("a\n")
    _git(repo, "add", ".gitignore")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "m")
    assert env.git_commit(repo) == _git(repo, "rev-parse", "--short", "HEAD")
    assert env.git_commit(repo / "copy") == "unknown"


def test_git_commit_outside_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # tmp_path may lie inside a checkout (nox puts TMPDIR under .nox/): stop git's upward search.
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert env.git_commit(tmp_path) == "unknown"


def test_utc_timestamp_converts_to_utc() -> None:
    plus_two = dt.timezone(dt.timedelta(hours=2))
    when = dt.datetime(2026, 11, 22, 6, 38, 5, 999, tzinfo=plus_two)
    assert env.utc_timestamp(when) == "2026-11-22T04:38:05Z"
