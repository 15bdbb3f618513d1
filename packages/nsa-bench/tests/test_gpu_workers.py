"""How the GPU tiers size their pytest-xdist workers (ci/gpu_workers.py) and spread them over the
GPUs (the root conftest.py's ``--worker-gpus``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from ci.gpu_workers import GIB_PER_WORKER, Gpu, parse_nvidia_smi, plan  # noqa: E402

H200 = Gpu("0", "NVIDIA H200", 143771)
H100 = Gpu("1", "NVIDIA H100 80GB HBM3", 81559)
RTX4090 = Gpu("0", "NVIDIA GeForce RTX 4090", 24564)


def test_a_card_takes_as_many_workers_as_its_memory_holds() -> None:
    assert GIB_PER_WORKER == 8
    assert plan([H200], cores=64).workers == 17  # 140 GiB / 8
    assert plan([H100], cores=64).workers == 9  # 79 GiB / 8
    assert plan([RTX4090], cores=16).workers == 2  # 23 GiB / 8
    small = Gpu("0", "NVIDIA GeForce RTX 2060", 6144)
    assert plan([small], cores=16).workers == 1  # never fewer than one per card


def test_the_cores_cap_the_workers_and_every_gpu_is_listed() -> None:
    two = plan([H200, Gpu("1", "NVIDIA H200", 143771)], cores=16)
    assert two.workers == 16  # 34 by memory, 16 by 16 cores at 1 each
    assert two.gpus == ("0", "1")
    assert "16 by 16 cores" in two.why
    assert plan([H200], cores=2).workers == 2
    assert plan([H200], cores=1).workers == 1


def test_no_gpu_means_no_workers() -> None:
    assert plan([], cores=16).workers == 0


def test_nvidia_smi_rows_parse() -> None:
    text = "0, NVIDIA H200, 143771\n1, NVIDIA H100 80GB HBM3, 81559\n"
    assert parse_nvidia_smi(text) == [H200, Gpu("1", "NVIDIA H100 80GB HBM3", 81559)]


PROBE = """
import os

def test_probe(request):
    worker = request.config.workerinput["workerid"]
    out = os.path.join(os.environ["PROBE_OUT"], worker)
    with open(out, "w") as f:
        f.write(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))

def test_second(request):
    test_probe(request)
"""


def test_each_xdist_worker_sees_one_gpu_of_the_list(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PROBE_OUT=str(out), PYTHONPATH=str(ROOT))
    # The root conftest.py loads as a plugin; --confcutdir keeps pytest from also loading it as
    # a conftest where tmp_path lies inside the checkout (nox puts its temporary folder there).
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest"]
    cmd += ["-c", str(tmp_path / "pytest.ini"), "--confcutdir", str(tmp_path)]
    cmd += ["-n", "3", "--worker-gpus", "5,7", str(tmp_path / "test_probe.py")]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = {path.name: path.read_text() for path in out.iterdir()}
    expected = {"gw0": "5", "gw1": "7", "gw2": "5"}
    assert seen, proc.stdout
    assert all(seen[worker] == expected[worker] for worker in seen)
