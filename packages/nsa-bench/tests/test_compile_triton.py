"""ci/compile_triton.py and ci/triton_launches.py: an interpreted launch, written down, compiles
for a real GPU target on a machine with no GPU, and every way it can fail is reported.

These need the checkout (ci/ is not installed): the root conftest.py puts its folder on sys.path.
They compile with Triton's own compiler, so they run without TRITON_INTERPRET.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from ci import compile_triton, triton_launches  # noqa: E402

COMBINE = "nsa_kernels.combine.kernels"


def combine_launch(dv: int = 16, br: int = 64, bd: int = 16) -> compile_triton.Launch:
    """combine_fwd_kernel as the interpreter tier records it: 5 fp32 tensors, 16 strides, 3
    sizes, then the constexprs and num_warps as keywords."""
    tensor = ("tensor", "float32")
    ints = [("int", "i32_div16")] * 16 + [("int", "i32")] * 3
    options = (("DV", ("value", dv)), ("BR", ("value", br)), ("BD", ("value", bd)))
    return compile_triton.Launch(
        COMBINE,
        "combine_fwd_kernel",
        (tensor,) * 5 + tuple(ints),
        (*options, ("num_warps", ("value", 4))),
    )


def combine_bwd_launch() -> compile_triton.Launch:
    """combine_bwd_kernel (its per-row gate sums reduce through shared memory)."""
    tensor = ("tensor", "float32")
    # Strides (do, o_cmp's two runs, o_sel, o_win, gates), then n_rows, T, HQ and the runs' split.
    ints = [("int", "i32_div16")] * 19 + [("int", "i32")] * 5
    flags = (
        ("WRITE_DO", ("value", True)),
        ("WRITE_DG", ("value", True)),
        ("CMP_RUNS", ("value", False)),
    )
    options = (("DV", ("value", 16)), ("BR", ("value", 64)), ("BD", ("value", 16)), *flags)
    return compile_triton.Launch(
        COMBINE,
        "combine_bwd_kernel",
        (tensor,) * 10 + tuple(ints),
        (*options, ("num_warps", ("value", 4))),
    )


def test_encode_keys_arguments_as_the_compiler_specializes_them() -> None:
    encode = triton_launches.encode
    assert encode(torch.zeros(2, dtype=torch.bfloat16), False) == ["tensor", "bfloat16"]
    assert encode(1, False) == ["int", "one"]
    assert encode(48, False) == ["int", "i32_div16"]
    assert encode(47, False) == ["int", "i32"]
    assert encode(2**40, False) == ["int", "i64"]
    assert encode(0.25, False) == ["float"]
    assert encode(48, True) == ["value", 48]  # a constexpr keeps its value
    assert encode(True, False) == ["value", True]
    with pytest.raises(TypeError, match="cannot record"):
        encode(object(), False)


@pytest.mark.parametrize("value", [1, 48, 47, 2**40 + 3])
def test_decode_gives_an_int_of_the_same_class(value: int) -> None:
    encoded = triton_launches.encode(value, False)
    assert triton_launches.encode(compile_triton.decode(encoded), False) == encoded


def test_a_recorded_launch_compiles_to_a_cubin_for_sm90() -> None:
    with compile_triton.compile_only_target(90):
        outcome = compile_triton.compile_launch(combine_launch(), 90)
    assert outcome.error is None
    assert outcome.shared is not None
    assert 0 <= outcome.shared <= compile_triton.MAX_SHARED_BYTES[90]


def test_a_launch_triton_cannot_compile_is_a_failure() -> None:
    # BD = 24 is not a power of two: tl.arange refuses it when the kernel compiles.
    with compile_triton.compile_only_target(90):
        outcome = compile_triton.compile_launch(combine_launch(dv=24, bd=24), 90)
    assert outcome.error is not None
    assert outcome.known is None


def test_too_much_shared_memory_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    with compile_triton.compile_only_target(90):
        fits = compile_triton.compile_launch(combine_bwd_launch(), 90)
    assert fits.error is None
    assert fits.shared is not None
    assert fits.shared > 0
    monkeypatch.setitem(compile_triton.MAX_SHARED_BYTES, 90, fits.shared - 1)
    with compile_triton.compile_only_target(90):
        outcome = compile_triton.compile_launch(combine_bwd_launch(), 90)
    assert outcome.error is not None
    assert "shared memory" in outcome.error


def _write(folder: Path, *launches: compile_triton.Launch, worker: str = "gw0") -> None:
    """The launches as the pytest plugin writes them (one worker's file)."""
    recorder = triton_launches.LaunchRecorder()
    for launch in launches:
        recorder.launches[(launch.module, launch.kernel, launch.args, launch.options)] = None
    recorder.write(folder, worker)


def test_run_passes_when_every_launch_compiles(tmp_path: Path) -> None:
    # Two workers that made the same launch: it is compiled once.
    _write(tmp_path, combine_launch(), worker="gw0")
    _write(tmp_path, combine_launch(), worker="gw1")
    assert compile_triton.load_launches(tmp_path) == [combine_launch()]
    assert compile_triton.run(tmp_path, [90]) == 0


def test_run_fails_on_a_new_failure_and_on_a_known_one_that_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, combine_launch(dv=24, bd=24))
    assert compile_triton.run(tmp_path, [90]) == 1
    known = compile_triton.KnownFailure("combine_fwd_kernel", {"BD": 24}, "listed for the test")
    monkeypatch.setattr(compile_triton, "KNOWN_FAILURES", (known,))
    assert compile_triton.run(tmp_path, [90]) == 0  # listed: reported, not failed
    _write(tmp_path, combine_launch())
    monkeypatch.setattr(
        compile_triton,
        "KNOWN_FAILURES",
        (compile_triton.KnownFailure("combine_fwd_kernel", {"BD": 16}, "listed, but it compiles"),),
    )
    assert compile_triton.run(tmp_path, [90]) == 1  # the list must not go stale


def test_no_recorded_launches_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no launches"):
        compile_triton.load_launches(tmp_path)
