"""``nsa-bench needle``: a small NSA language model learns passkey retrieval beyond its window.

Task (passkey). A sequence of T tokens is random filler with one needle, ``KEY v1 .. vL``
written ``needle_repeats`` times in a row (the classic passkey prompt states its key twice), and
ends in ``QUERY v1 .. vL``: the model must repeat the L value tokens after QUERY. Value token k
is drawn from its own range of ``value_vocab`` ids (k = 1..L), so the answer is a lookup of the
one token of range k+1 in the sequence; filler never uses those ids. The loss covers the L answer
tokens only (the predictions at QUERY, v1, .., v(L-1)). Accuracy is the exact match of the L
greedy tokens under teacher forcing, which equals greedy decoding: a decode that went wrong at
token k fails the match either way. Chance is ``value_vocab ** -L`` (one token: 1/value_vocab).

Depth. The needle starts at ``p = lo + round(depth * (hi - lo))``: ``lo = l'`` keeps it out of
the forced initial selection block; ``hi`` puts its last token just beyond the reach of the
stacked sliding windows of the QUERY row, ``layers * (w - 1)`` tokens (a window-only model
relays one window per layer), so no scored row can see it through the windows or its two forced
local blocks (``2 l' <= w``). Training draws p uniformly in [lo, hi].

Models (``--variants``), trained one after the other under the same step cap and time budget:

- ``nsa``: :class:`nsa_core.NSAAttention` as it is, every op through the backend registry (the
  Triton kernels on a GPU);
- ``window``: the sliding branch alone, ``o = g_win * o_win`` (the compressed and selected
  branches are not computed);
- ``random``: NSA with the top-n replaced by random blocks: the forced blocks plus random
  distinct valid ones, drawn afresh per call (:func:`nsa_bench.sel_bench.nsa_block_indices`).

Each model: token embedding, ``--layers`` pre-norm blocks (attention, then a GELU MLP), final
norm and LM head; bf16 autocast over float32 weights on CUDA, float32 on CPU.

After training: accuracy per (length, depth) cell over ``--samples`` sequences, for every model
on the same sequences; the selection statistics of the ``nsa`` model on a held-out sequence of
each of ``--stats-lens`` tokens (:mod:`nsa_bench.sel_stats`), with its per-layer indices saved for
``nsa-bench sel --indices``. ``--eval-only --ckpt DIR`` reloads the checkpoints instead of
training.

Outputs under ``--out``: ``<variant>.pt`` (bf16 state dict and the run's settings),
``needle.csv`` and ``needle.json`` (one row per model, length and depth),
``needle_<variant>.png`` (depth x length heat map; needs matplotlib), ``sel_stats.csv``,
``sel_indices_T<T>_layer<i>.pt``, and ``needle.md``, the Markdown tables also printed last.

Modules: :mod:`~nsa_bench.needle.task` (the passkey data and the accuracy rule),
:mod:`~.model` (the variants' attention and the LM), :mod:`~.settings` (what a run depends on),
:mod:`~.train` (training and checkpoints), :mod:`~.evaluate` (accuracy and selection
statistics), :mod:`~.report` (tables, files, merged runs) and :mod:`~.cli` (flags and the run).
"""
