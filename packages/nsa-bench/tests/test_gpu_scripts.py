"""The GPU host scripts (ci/gpu_*.sh) on a CPU: valid bash, and the needle script's flow.

These need the checkout (ci/ is not installed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = sorted((ROOT / "ci").glob("gpu_*.sh"))
TINY = (
    "--steps=2 --lengths=96 --depths=0.5 --samples=2 --log-every-s=0 --stats-lens= "
    "--layers=2 --hidden=32 --heads=4 --kv-heads=2 --head-dim=16 --cmp-block=8 --cmp-stride=4 "
    "--sel-block=8 --num-selected=4 --window=16 --train-len=96 --batch=2 --device=cpu"
)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_gpu_script_is_valid_bash(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_gpu_needle_trains_each_model_apart_and_merges(tmp_path: Path) -> None:
    # No GPU: every model runs on "GPU 0" one after the other, as on a one-GPU host.
    env = {**os.environ, "OUT": str(tmp_path), "NEEDLE_ARGS": TINY, "PACK_LOGS": "0"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    run = subprocess.run(
        ["bash", str(ROOT / "ci" / "gpu_needle.sh"), "window,nsa"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "needle window (GPU 0): exit 0" in summary
    assert "needle nsa (GPU 0): exit 0" in summary
    assert "merge: exit 0" in summary
    record = json.loads((tmp_path / "needle.json").read_text())
    assert set(record["train"]) == {"nsa", "window"}
    assert "| T | depth | nsa | window |" in (tmp_path / "needle.md").read_text()
    for variant in ("nsa", "window"):
        assert (tmp_path / variant / f"{variant}.pt").is_file()
