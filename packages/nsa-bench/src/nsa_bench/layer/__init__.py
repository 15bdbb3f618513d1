"""``nsa-bench layer``: the whole NSA layer against full attention and fla-core, over T.

For each head-dim pair (``--head-dims``, default the dk=dv=128 shape and the paper's 192/128),
each length T (``--seqlens``, default 8k..128k) and each mode (``fwd``, ``fwdbwd``) every method
runs on the same random inputs (B=1, HQ=64, H=4, l=32, d=16, l'=64, n=16, w=512, bf16 by
default) and is timed with ``triton.testing.do_bench`` medians on CUDA (the host clock on CPU,
for smoke runs at tiny shapes):

- ``nsa_core``: ``nsa_core.nsa_attention(q, k, v, gates, config)``, i.e. compress, select, the
  three branches and the gated combine, with one K/V shared by the three branches;
- ``nsa_module``: ``nsa_core.NSAAttention(config, hidden_size)`` on x [B, T, hidden]: the
  projections, RoPE, the gate MLP and the output projection included;
- ``fla``: fla-core's ``parallel_nsa``, compression and selection with its own top-n (its
  compression mean-pools l'-token blocks: l = d = l'), cmp and sel gates, no window;
- ``sdpa``: torch SDPA, causal, GQA through ``enable_gqa=True`` (kv heads repeated only on a
  torch without it, and the row says so);
- ``fa2``: ``flash_attn_func``, causal, native GQA (v zero-padded to dk when dv != dk).

Every row has ``vs_<peer>``: the peer's median over this row's median in the same
(head dims, T, mode) case, so > 1 means faster than that peer. The core is also timed step
by step (``compress``, ``select_blocks``, ``compressed``, ``selected``, ``sliding``,
``combine``), each through nsa_core's public op with the backend the registry routes it to named
in the row, and its share of the whole core, in the modes of ``--step-modes`` (default the
forward; ``fwdbwd`` times each step's forward and backward). ``--step-backends
sliding=triton_win`` adds a ``sliding@triton_win`` row timed with that backend pinned, to
compare backends of one step in one run. ``peak_mib`` is
``torch.cuda.max_memory_allocated`` over the row's runs (inputs included), ``work_mib`` the part
above what was allocated when the row started.

A peer that refuses a shape, a missing package and an out-of-memory case each become a row whose
``status`` says why (``skipped: ``, ``refused: ``, ``oom: ``, ``error: ``), never a crash. Under
``--out`` (default ``artifacts/bench/layer/``): ``layer.csv`` and ``layer.json`` (one schema, the
environment as ``env_*`` in every row, rewritten after every case so a stopped run keeps what it
measured), ``layer.png`` (ms against T, log-log, one line per method and mode; needs matplotlib,
``nsa-bench[plot]``) and ``layer.md``, the Markdown tables that are also printed last.
``--merge A.csv B.csv`` rebuilds every output from earlier runs' rows (e.g. one run per T range).

Modules: :mod:`~nsa_bench.layer.rows` (the row schema, ratios, files), :mod:`~.inputs` (a case's
inputs and timed calls), :mod:`~.measure` (one row timed, failures as statuses), :mod:`~.nsa`
(the NSA methods and their routing), :mod:`~.peers`, :mod:`~.steps` (the core step by step),
:mod:`~.tables` (the Markdown), :mod:`~.plot` (the PNG) and :mod:`~.cli` (flags, sweep, merge).
"""
