"""nsa-kernels tests: this folder holds ``kernel_testlib``, which the tests of every step import.

pytest (import mode ``prepend``, the default) puts the folder of each conftest.py on ``sys.path``
before it collects below it, so ``import kernel_testlib`` works from every subfolder whichever
paths a tier names (ci/tiers.py).
"""
