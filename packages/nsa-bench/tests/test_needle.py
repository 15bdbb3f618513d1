"""``nsa-bench needle`` on the CPU: the passkey data, the accuracy rule, the ablations, the
selection statistics and a three-step run end to end (reference ops, tiny shapes)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from nsa_bench.cli import build_parser, main
from nsa_bench.needle import cli as needle_cli
from nsa_bench.needle.model import VARIANTS, NeedleAttention, NeedleModel
from nsa_bench.needle.settings import NeedleSettings
from nsa_bench.needle.task import (
    IGNORE,
    NeedleBatch,
    NeedleTask,
    answer_hits,
    needle_batch,
    needle_span,
)
from nsa_bench.sel_stats import fit_indices, indices_for_bench, load_indices, selection_stats

# Tiny geometry: l=8, d=4, l'=8, n=4, w=16, 2 layers (reach 31 tokens), T=96. One line each:
# the model, its block geometry, the task, the training batches.
TINY = NeedleSettings(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=16,
                      cmp_block=8, cmp_stride=4, sel_block=8, num_selected=4, window=16,
                      filler_vocab=16, value_len=3, value_vocab=8, needle_repeats=2,
                      train_len=96, batch=2)  # fmt: skip
# The same settings as flags (one per field, as the command names them), on the CPU.
TINY_ARGS = [f"--{f.name.replace('_', '-')}={getattr(TINY, f.name)}" for f in fields(TINY)]
TINY_ARGS.append("--device=cpu")


def _check_layout(nb: NeedleBatch, task: NeedleTask, t: int, reach: int, l_sel: int) -> None:
    ln, needle_len = task.value_len, task.needle_len
    assert needle_len == task.needle_repeats * (ln + 1)
    q0 = t - ln - 1
    for b in range(nb.tokens.shape[0]):
        row, p = nb.tokens[b].tolist(), int(nb.starts[b])
        answer = nb.answers[b].tolist()
        assert row[p : p + needle_len] == ([task.key_id, *answer]) * task.needle_repeats
        assert row[q0] == task.query_id
        assert row[q0 + 1 :] == answer
        # Each special or value id appears only where the layout puts it.
        needle_at = {*range(p, p + needle_len), q0, *range(q0 + 1, t)}
        assert all(tok < task.filler_vocab for i, tok in enumerate(row) if i not in needle_at)
        # Answer range k holds the k-th value.
        for k, value in enumerate(nb.answers[b].tolist()):
            assert task.value_base(k) <= value < task.value_base(k) + task.value_vocab
        # No scored row (q0 .. T-2) reaches the needle through the windows of every layer,
        # nor through its forced blocks (block 0 and the two local ones).
        last = p + needle_len - 1
        for r in range(q0, t - 1):
            assert last < r - reach + 1
            assert p >= l_sel
            assert (r // l_sel - 1) * l_sel > last


def test_needle_sits_where_the_depth_says_beyond_the_windows() -> None:
    task = TINY.task()
    t, reach, l_sel = 120, TINY.reach, TINY.sel_block
    lo, hi = needle_span(task, t, reach, l_sel)
    assert (lo, hi) == (l_sel, t - task.value_len - 1 - reach - task.needle_len + 1)
    gen = torch.Generator().manual_seed(0)
    for depth, expected in ((0.0, lo), (1.0, hi), (0.5, lo + round(0.5 * (hi - lo)))):
        nb = needle_batch(task, 3, t, reach, l_sel, gen, depth=depth)
        assert nb.starts.tolist() == [expected] * 3
        _check_layout(nb, task, t, reach, l_sel)
    drawn = needle_batch(task, 64, t, reach, l_sel, gen)
    _check_layout(drawn, task, t, reach, l_sel)
    assert int(drawn.starts.min()) >= lo
    assert int(drawn.starts.max()) <= hi
    assert len(set(drawn.starts.tolist())) > 10  # drawn, not fixed
    with pytest.raises(ValueError, match="too short"):
        needle_span(task, 40, reach, l_sel)


def test_answer_mask_scores_the_answer_tokens_only() -> None:
    task = TINY.task()
    nb = needle_batch(task, 4, 96, TINY.reach, TINY.sel_block, torch.Generator().manual_seed(1))
    ln = task.value_len
    assert nb.targets.shape == (4, ln + 1)
    # Logit row i of the last L+1 predicts the token after it: the answer, then nothing.
    assert torch.equal(nb.targets[:, :ln], nb.tokens[:, -ln:])
    assert torch.equal(nb.targets[:, :ln], nb.answers)
    assert (nb.targets[:, ln] == IGNORE).all()


def test_answer_hits_on_a_hand_made_case() -> None:
    targets = torch.tensor([[1, 2, IGNORE], [1, 2, IGNORE], [0, 0, IGNORE]])
    logits = torch.zeros(3, 3, 4)
    logits[0, 0, 1] = logits[0, 1, 2] = 1.0  # both right; the unscored row says 3
    logits[0, 2, 3] = 5.0
    logits[1, 0, 1] = logits[1, 1, 3] = 1.0  # second wrong
    logits[2, 0, 2] = logits[2, 1, 3] = 1.0  # both wrong
    exact, token = answer_hits(logits, targets)
    assert exact.tolist() == [True, False, False]
    assert token.tolist() == [1.0, 0.5, 0.0]


def test_random_selection_keeps_the_index_rules() -> None:
    attn = NeedleAttention(TINY.nsa_config(), TINY.hidden, "random")
    attn.generator = torch.Generator().manual_seed(2)
    n, l_sel, t = TINY.num_selected, TINY.sel_block, 80
    idx = attn.random_block_indices(2, t, torch.device("cpu"))
    assert idx.shape == (2, t, TINY.kv_heads, n)
    assert idx.dtype == torch.int32
    free_choices = set()
    for r in range(t):
        jt = r // l_sel
        for row in idx[:, r].reshape(-1, n).tolist():
            valid = [j for j in row if j >= 0]
            assert row == valid + [-1] * (n - len(valid))  # -1 only at the end
            assert valid == sorted(set(valid))  # ascending, distinct
            assert all(j <= jt for j in valid)  # causal
            assert {0, jt, max(jt - 1, 0)} <= set(valid)  # forced blocks
            assert len(valid) == min(n, jt + 1)
            free_choices.add(tuple(valid))
    assert len(free_choices) > 10  # random beyond the forced blocks


def test_window_ablation_cannot_see_the_needle_but_nsa_can() -> None:
    torch.manual_seed(0)
    task = TINY.task()
    nb = needle_batch(task, 2, 96, TINY.reach, TINY.sel_block, torch.Generator().manual_seed(3))
    other = nb.tokens.clone()
    rows = torch.arange(2)
    # Another value at the needle; the tail (the teacher-forced answer) stays as it was.
    other[rows, nb.starts + 1] = (
        task.value_base(0) + (nb.answers[:, 0] - task.value_base(0) + 1) % 8
    )
    ln = task.value_len + 1
    for variant, should_change in (("window", False), ("nsa", True), ("random", True)):
        model = TINY.build(variant, torch.device("cpu"))
        for attn in model.attentions():
            attn.generator = torch.Generator().manual_seed(4)
        with torch.no_grad():
            a = model(nb.tokens, ln)
            for attn in model.attentions():
                attn.generator = torch.Generator().manual_seed(4)
            b = model(other, ln)
        assert torch.equal(a, b) != should_change, variant


def test_recording_the_selection_changes_nothing_else() -> None:
    model = TINY.build("nsa", torch.device("cpu"))
    tokens = needle_batch(
        TINY.task(), 2, 96, TINY.reach, TINY.sel_block, torch.Generator().manual_seed(5)
    ).tokens
    with torch.no_grad():
        plain = model(tokens, 4)
        for attn in model.attentions():
            attn.recorded = []
        recorded = model(tokens, 4)
    assert torch.equal(plain, recorded)
    for attn in model.attentions():
        assert attn.recorded is not None
        [indices] = attn.recorded
        assert indices.shape == (2, 96, TINY.kv_heads, TINY.num_selected)
        # The last row sees more blocks than n: every slot is filled.
        assert (indices[:, -1] >= 0).all()


def test_selection_stats_on_hand_made_indices() -> None:
    t, n, l_sel = 128, 4, 8
    same = torch.tensor([0, 1, 2, 3], dtype=torch.int32).expand(1, t, 1, n)
    s = selection_stats(same, l_sel, source="same", layer=0)
    assert s.share_next == 1.0
    assert s.mean_count == 4.0
    assert s.union_16 == 4.0
    assert s.saved_16 == pytest.approx(1 - 1 / 16)
    assert s.saved_64 == pytest.approx(1 - 1 / 64)
    # Rows alternate between two disjoint sets; row 0 pads one slot with -1.
    even = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    odd = torch.tensor([4, 5, 6, 7], dtype=torch.int32)
    rows = torch.stack([even if r % 2 == 0 else odd for r in range(t)]).view(1, t, 1, n)
    rows[0, 0, 0, 3] = -1
    s = selection_stats(rows, l_sel, source="alternate", layer=0)
    assert s.share_next == 0.0
    assert s.union_16 == 8.0
    assert s.saved_16 == pytest.approx(1 - 8 * 8 / (t * 4 - 1))
    assert s.mean_count == pytest.approx((t * 4 - 1) / t)


def test_tiny_run_trains_evaluates_and_reloads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    common = [
        "--lengths=96,128",
        "--depths=0.2,0.8",
        "--samples=3",
        "--eval-batch=2",
        "--stats-lens=128",
        "--log-every-s=0",
        *TINY_ARGS,
    ]
    assert main(["needle", f"--out={out}", "--steps=3", "--budget-s=60", *common]) == 0
    printed = capsys.readouterr()
    assert "| nsa | 3 |" in printed.out
    assert "## Passkey exact match" in printed.out
    assert "# train random step 3" in printed.err
    record = json.loads((out / "needle.json").read_text())
    assert {v: record["train"][v]["steps"] for v in VARIANTS} == {v: 3 for v in VARIANTS}
    cells = record["cells"]
    assert len(cells) == 3 * 2 * 2
    assert all(c["samples"] == 3 and c["status"] == "ok" for c in cells)
    assert len((out / "needle.csv").read_text().splitlines()) == 1 + len(cells)
    for variant in VARIANTS:
        ckpt = out / f"{variant}.pt"
        assert 0 < ckpt.stat().st_size < 16 << 20
        state = torch.load(ckpt, weights_only=True)["state"]
        assert all(v.dtype == torch.bfloat16 for v in state.values())
    idx, meta = load_indices(out / "sel_indices_T128_layer1.pt")
    assert idx.shape == (1, 128, TINY.kv_heads, TINY.num_selected)
    assert meta["sel_block"] == TINY.sel_block
    assert meta["layer"] == 1
    assert torch.equal(fit_indices(idx, 64, 4), idx[:1, :64, [0, 1, 0, 1]])
    for_bench = indices_for_bench(
        out / "sel_indices_T128_layer1.pt", 64, 4, TINY.num_selected, TINY.sel_block
    )
    assert for_bench.shape == (1, 64, 4, TINY.num_selected)
    with pytest.raises(ValueError, match="the bench runs n=16"):
        indices_for_bench(out / "sel_indices_T128_layer1.pt", 64, 4, 16, TINY.sel_block)
    with pytest.raises(ValueError, match="fewer than T=256"):
        fit_indices(idx, 256, 4)
    stats = [s for s in record["sel_stats"] if s["source"] == "nsa"]
    assert [s["layer"] for s in stats] == [0, 1]

    again = tmp_path / "again"
    args = ["needle", f"--out={again}", "--eval-only", f"--ckpt={out}", *common]
    assert main(args) == 0
    reloaded = json.loads((again / "needle.json").read_text())
    # The run evaluated its checkpoints' weights: reloading them gives the same numbers.
    assert reloaded["cells"] == cells
    assert reloaded["train"]["nsa"]["steps"] == 3


def test_a_failing_model_leaves_the_others_standing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_train = needle_cli.train

    def train_or_fail(model: NeedleModel, variant: str, *args: object, **kw: object) -> object:
        if variant == "window":
            raise RuntimeError("kernel refused")
        return real_train(model, variant, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(needle_cli, "train", train_or_fail)
    out = tmp_path / "run"
    argv = ["needle", f"--out={out}", "--steps=1", "--variants=window,nsa", "--lengths=96"]
    argv += ["--depths=0.5", "--samples=1", "--stats-lens=", *TINY_ARGS]
    assert main(argv) == 1
    record = json.loads((out / "needle.json").read_text())
    assert record["train"]["window"] == {"error": "RuntimeError: kernel refused"}
    assert [c["variant"] for c in record["cells"]] == ["nsa"]
    assert "failed: RuntimeError: kernel refused" in (out / "needle.md").read_text()


def test_runs_of_one_variant_each_merge_into_one_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--steps=2", "--lengths=96", "--depths=0.5", "--samples=2", "--log-every-s=0"]
    common += ["--stats-lens=", *TINY_ARGS]
    for variant in ("window", "nsa"):
        argv = ["needle", f"--out={tmp_path / variant}", f"--variants={variant}", *common]
        assert main(argv) == 0
    capsys.readouterr()
    merged = tmp_path / "merged"
    argv = ["needle", f"--out={merged}", "--merge", str(tmp_path / "window"), str(tmp_path / "nsa")]
    assert main(argv) == 0
    record = json.loads((merged / "needle.json").read_text())
    assert set(record["train"]) == {"nsa", "window"}
    apart = [
        c
        for v in ("window", "nsa")
        for c in json.loads((tmp_path / v / "needle.json").read_text())["cells"]
    ]
    assert sorted(map(str, record["cells"])) == sorted(map(str, apart))
    assert "| T | depth | nsa | window |" in capsys.readouterr().out  # VARIANTS order

    other = tmp_path / "other"
    argv = ["needle", f"--out={other}", "--variants=random", *common, "--seed=5"]
    assert main(argv) == 0
    with pytest.raises(SystemExit, match=r"other settings \(seed\)"):
        main(["needle", f"--out={merged}", "--merge", str(tmp_path / "nsa"), str(other)])
    with pytest.raises(SystemExit, match=r"repeats variants \['nsa'\]"):
        main(["needle", f"--out={merged}", "--merge", str(tmp_path / "nsa"), str(tmp_path / "nsa")])


def test_sel_bench_takes_an_indices_file(tmp_path: Path) -> None:
    indices = tmp_path / "sel.pt"
    indices.write_bytes(b"")  # the parser checks that the file exists, not what it holds
    args = build_parser().parse_args(["sel", "--prefill", "--indices", str(indices)])
    assert args.indices == str(indices)
    assert build_parser().parse_args(["sel", "--prefill"]).indices is None
