"""GPU robustness of the Triton kernels: compute-sanitizer, long sequences, randomized parity.

One command per part; ``ci/gpu_robustness.sh`` runs them on a GPU host with a timeout each and
prints the summary last. Each part writes ``<part>.json`` under ``--out`` (progress goes to
stderr); ``report`` merges them into ``report.json`` and ``report.md``::

    python ci/gpu_robustness.py sanitize          # memcheck + racecheck over the kernel sweep
    python ci/gpu_robustness.py sanitize-target   # the sweep itself (what the sanitizer runs)
    python ci/gpu_robustness.py long              # T = 128k, 256k: selected branch and the core
    python ci/gpu_robustness.py parity            # 200 random cases, every GPU backend
    python ci/gpu_robustness.py plan              # the parity cases of a seed (no GPU needed)
    python ci/gpu_robustness.py report            # merge the parts, print one line per part

What each part checks:

- ``sanitize``: a sweep of small shapes that launches every Triton kernel of nsa_kernels
  (block scoring, compressed and selected branches forward and backward, dense and varlen,
  G in {1, 3, 16}, lengths that end inside every block and tile, a varlen batch with a
  sequence of one token, the gated combine, the attention core, the fused decode step) runs
  plainly (checking results against the reference and failing on any kernel it never launched)
  and under ``compute-sanitizer --tool memcheck`` and ``--tool racecheck``: 0 errors each. Each
  run is split into ``--shards`` processes, all started together: Triton compiles on the CPU.
- ``long``: T = 128k and 256k, B = 1, HQ = 64, H = 4, d = 128, bf16, the paper's l=32, d=16,
  l'=64, n=16, w=512: the Triton selected branch forward and backward, then the whole attention
  core (``nsa_core.nsa_attention``) on its default routes; outputs and row gradients of 64 sampled
  rows (the last ones included) against a float32 recomputation of those rows with the reference
  ops (``q_start`` = the row), block indices under the index contract, every gradient finite.
- ``parity``: random shapes and configs from a fixed seed; every non-reference backend of every op
  that accepts a case, pinned through the toggles (``NSA_<STEP>_BACKEND`` as a ``Toggles`` value),
  against the reference in float32 (float64 for float32 inputs). The cases share a few
  geometries (each compiles its own kernels) and run in one worker process per geometry.
  ``--seed S --case N`` replays one case; case N of a seed is the same whatever ``--cases``.

Bounds are docs/spec.md's ("Tolerances"): relative error ||out - ref|| / ||ref|| at most 1e-5 for
float32 against float64, 1e-2 for bfloat16 and 5e-3 for float16 against float32, gradients twice
that; block scoring keeps the index contract (``nsa_kernels.scoring.contract``).

``--device cpu`` runs the same code on tiny shapes with the Triton backends called by name under
``TRITON_INTERPRET=1`` (the registry routes every CPU call to the reference), so the script can be
exercised without a GPU; bfloat16 and the sanitizer need the GPU.

The modules, one job each: ``cli`` (the commands and their flags), ``plan`` (the parity cases of
a seed, pure Python), ``sweep`` (the small-shape cases the sanitizer runs), ``launches`` (which
Triton kernels a block of code launched), ``sanitize`` (the sweep under compute-sanitizer and its
logs read back), ``long`` (long sequences), ``parity`` (randomized parity), ``report`` (the parts'
JSON and the summary), ``runtime`` (the device, the ops and the error measures the GPU parts
share), ``children`` (child processes run side by side, each under a timeout) and ``common``
(paths, bounds and progress lines). Only the GPU parts import torch, inside their functions, so
``plan`` and ``report`` run without it.
"""
