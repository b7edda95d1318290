"""The benchmark harness on the CPU: result rows and their provenance, the renderer, BENCHMARKS.md in step
with the committed rows, and bench_attention.py's row-making under the Triton interpreter with stand-in
timers."""

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import render  # noqa: E402  (benchmarks/ on sys.path first)
import utils  # noqa: E402


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setenv("STIEFKV_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("STIEFKV_COMMIT", "0123456789abcdef")
    monkeypatch.setenv("STIEFKV_DIRTY", "0")
    utils.provenance.cache_clear()
    yield tmp_path
    utils.provenance.cache_clear()


def test_quantiles_interpolate_like_torch():
    samples = [3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.0]
    expected = torch.quantile(
        torch.tensor(samples, dtype=torch.float64), torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)
    )
    got = utils.quantiles(samples)
    assert [got["p20"], got["p50"], got["p80"]] == pytest.approx(expected.tolist())
    with pytest.raises(ValueError, match="no samples"):
        utils.quantiles([])


def test_write_rows_appends_rows_with_provenance(results):
    utils.write_rows("demo", {"case": "a", "ms": {"p50": 1.0}})
    utils.write_rows(
        "demo", [{"case": "b"}, {"case": "c", "remeasured": False, "provenance": {"date": "then"}}]
    )
    rows = utils.read_rows(results / "demo.jsonl")
    assert [r["case"] for r in rows] == ["a", "b", "c"]
    assert rows[0]["bench"] == "demo" and rows[0]["remeasured"] is True
    p = rows[0]["provenance"]
    assert p["commit"] == "0123456789abcdef" and p["dirty"] is False
    assert {"date", "torch", "python", "command", "run_id", "machine"} <= set(p)
    assert rows[1]["provenance"]["run_id"] == p["run_id"]  # one process, one run
    assert rows[2]["provenance"] == {"date": "then"} and rows[2]["remeasured"] is False
    with pytest.raises(ValueError, match="no 'case'"):
        utils.write_rows("demo", {"ms": 1.0})


def test_render_prefers_the_newest_measured_row(tmp_path):
    rows = [
        {"case": "x", "v": 1, "remeasured": True, "provenance": {"date": "old"}},
        {"case": "x", "v": 2, "remeasured": True, "provenance": {"date": "new"}},
        {"case": "x", "v": 3, "remeasured": False, "provenance": {"date": "transcribed"}},
        {"case": "y", "v": 4, "remeasured": False, "provenance": {"date": "transcribed"}},
    ]
    (tmp_path / "f.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = render.Results(tmp_path)
    assert res.pick("f", "x")["v"] == 2
    assert res.pick("f", "y")["v"] == 4  # no measured row: the transcribed one, marked as such
    assert "not re-measured" in render.src(res.pick("f", "y"))
    assert [r["v"] for r in res.cases("f")] == [2, 4]


def test_a_renamed_case_shows_only_its_newest_row(tmp_path):
    """Two cases the serve table labels alike (the budget added to a case's name since) show once: the newer
    row, in the first one's place; the older no longer counts among the runs."""
    rows = [
        {"case": "a", "label": 1, "v": 1, "remeasured": True, "provenance": {"date": "2026-12-01 18:33"}},
        {"case": "b", "label": 2, "v": 2, "remeasured": True, "provenance": {"date": "2026-12-01 19:00"}},
        {"case": "a 0.5", "label": 1, "v": 3, "remeasured": True, "provenance": {"date": "2026-12-03 08:03"}},
        {"case": "c", "label": 2, "v": 4, "remeasured": True, "provenance": {"date": "2026-11-30 10:00"}},
    ]
    (tmp_path / "f.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = render.Results(tmp_path)
    got = render._newest_per_label(res, res.cases("f"), lambda r: r["label"])
    assert [r["v"] for r in got] == [3, 2]
    assert sorted(r["v"] for _, r in res.used.values()) == [2, 3]


def test_compaction_rows_are_labelled_by_their_options_and_the_pass_key_claim_finds_its_run(tmp_path):
    """A row without ``pin`` predates it (pin 0) and merges with a later ``am pin0`` row of the same setting
    (the newest shown); ``null`` is the default of its day, 0.0 is 0, and eviction's 0 is its default; the
    pass-key claim brackets the default with ``pin=0`` of the same run."""
    fit = {"allocation": "layers-max", "pooling": "rms", "solver": "projected", "block": 4096}

    def row(method, options, run, accuracy, context=4096):
        return {"case": f"{method} passkey C{context} keep0.1 n20 cuda", "method": method, "keep": 0.1,
                "context": context, "samples": 20, "accuracy": accuracy, "accuracy_full": 1.0,
                "kept_tokens": round(0.1 * context),
                "window": 1024, "options": options, "remeasured": True,
                "provenance": {"run_id": run, "date": run}}

    rows = [row("am", fit, "a", 0.25), row("am pin0", {**fit, "pin": 0}, "b", 0.3),
            row("am", {**fit, "pin": None}, "b", 0.95), row("am", {**fit, "pin": None}, "b", 1.0, 2048),
            row("am pin0", {**fit, "pin": 0.0}, "c", 0.5, 2048)]
    (tmp_path / "retrieval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = render.Results(tmp_path)
    got = render.compaction_rows(res, "retrieval", lambda case: True)
    assert [(render.compaction_label(r), r["accuracy"]) for r in got] == [
        ("am (pin 0)", 0.3), ("am (default)", 0.95), ("am (default)", 1.0), ("am (pin 0)", 0.5)]
    assert render.compaction_label({"method": "attention", "options": {"allocation": "uniform",
                                                                       "pooling": "mean", "pin": 0}}) \
        == "attention (default)"
    assert render.compaction_label({"method": "am", "options": {**fit, "pin": {
        "share": 0.2, "floor": 64, "cap": 0.25}}}) == "am (pin 0.2, ≥ 64, ≤ 0.25, from 0)"
    # the default recorded before "from" (pins at every count) is the default where it pins as many tokens
    before = {"share": 0.1, "floor": 64, "cap": 0.25}
    assert render.compaction_label({"method": "am", "kept_tokens": 410, "options": {**fit, "pin": before}}) \
        == "am (default)"
    assert render.compaction_label({"method": "am", "kept_tokens": 102, "options": {**fit, "pin": before}}) \
        == "am (pin 0.1, ≥ 64, ≤ 0.25, from 0)"
    assert render.compaction_label({"method": "am", "kept_tokens": 102, "options": {**fit, "pin": 0}}) \
        == "am (default)"
    assert render.compaction_label({"method": "am", "kept_tokens": 410, "options": {**fit, "pin": 0}}) \
        == "am (pin 0)"
    claims = []
    render.retrieval_claim(res, lambda *a: claims.append(a), 1024)
    (text, value, _, met, shown), = claims
    assert "C 2048 / 4096" in text and met
    assert value.startswith("1.00 (0.50) / 0.95 (0.30)")  # C 2048: run c's, the only one; C 4096: run b's


def test_bench_compaction_speed_times_the_pinned_default_and_records_it(results, monkeypatch):
    """``bench_compaction_speed.py`` times what ``compact`` runs, pins included, and records the pin as
    resolved: the default's row is the default, ``--pin 0``'s is not."""
    import bench_compaction_speed as bcs

    for pin in ("default", "0"):
        monkeypatch.setattr(sys, "argv", ["bench_compaction_speed.py", "--shape", "tiny", "--lengths", "1301",
                                          "--device", "cpu", "--repeat", "1", "--pin", pin])
        with torch.no_grad():  # main() turns gradients off for the process; this restores them after
            bcs.main()
    rows = utils.read_rows(results / "compaction_speed.jsonl")
    assert [r["case"] for r in rows] == ["tiny T1301 keep0.1 cpu", "tiny T1301 keep0.1 pin0 cpu"]
    labels = [render.compaction_label({"method": "am", "options": r["options"]}) for r in rows]
    assert labels == ["am (default)", "am (pin 0)"] and all(r["seconds"] > 0 for r in rows)


def test_bench_compaction_names_a_score_and_model_other_than_the_defaults(results, monkeypatch, tmp_path):
    """The case named neither ``--score`` nor the model and rows had no ``model``: a ``--score 128`` run
    wrote the case of the 512-token rows of its context, and render merged them in its table and claims.
    The default's cases stay as committed, whether the model is named by its alias or a copy of its file."""
    import importlib

    import stiefkv
    from stiefkv.longcontext import CompactedResult

    bc = importlib.import_module("bench_compaction")
    monkeypatch.setattr(stiefkv, "load_model", lambda *a, **k: (None, None))

    def evaluate_compacted(model, tok, *, context, score, keep, method, chunks, **kwargs):
        return CompactedResult(method=method, keep=keep, context=context, score=score, chunks=chunks or 3,
                               tokens=score, ppl=30.0 if score == 512 else 20.0, ppl_full=20.0,
                               kept_tokens=round(keep * context), held_tokens=keep * context,
                               bytes_fraction=keep)

    monkeypatch.setattr(bc, "evaluate_compacted", evaluate_compacted)
    copy = tmp_path / "model.gguf"  # a copy of the default model's file under another path
    copy.write_bytes(b"GGUF" + bytes(60))
    import hashlib
    monkeypatch.setattr(utils, "DEFAULT_MODEL_FILE", (64, hashlib.sha256(copy.read_bytes()).hexdigest()))
    utils.model_name.cache_clear()  # names are remembered per spec
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(61))
    for argv in (["smollm2"], [str(copy)], ["smollm2", "--score", "128"], [str(other)]):
        monkeypatch.setattr(sys, "argv", ["bench_compaction.py", *argv, "--methods", "snapkv", "--device",
                                          "cuda"])
        with torch.no_grad():  # main() turns gradients off for the process; this restores them after
            bc.main()
    rows = utils.read_rows(results / "compaction.jsonl")
    assert [(r["case"], r["model"]) for r in rows] == [
        ("snapkv C4096 keep0.1 cuda", "smollm2"), ("snapkv C4096 keep0.1 cuda", "smollm2"),
        ("snapkv C4096 keep0.1 score128 cuda", "smollm2"),
        ("snapkv C4096 keep0.1 other.gguf cuda", str(other))]
    # render's table and claims read the default score's rows of the default model only
    res = render.Results(results)
    assert [r["case"] for r in render.compaction_rows(res, "compaction", lambda case: True)] == [
        "snapkv C4096 keep0.1 cuda"]
    assert "+10.00" in render.compaction(res) and "+0.00" not in render.compaction(res)


def test_render_refuses_unknown_blocks(tmp_path):
    with pytest.raises(ValueError, match="unknown render blocks"):
        render.render("<!-- render:nope -->\n<!-- /render:nope -->\n", render.Results(tmp_path))


def test_render_refuses_a_missing_results_folder_and_names_a_malformed_row(tmp_path, monkeypatch, capsys):
    """A mistyped ``--results`` rendered every table empty and wrote that over the document (exit 0); a
    truncated row failed with json's traceback, counted from the start of its line, naming no file."""
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- render:pareto -->\nold\n<!-- /render:pareto -->\n")
    (tmp_path / "empty").mkdir()

    def run(*argv):
        monkeypatch.setattr(sys, "argv", ["render.py", "--doc", str(doc), *argv])
        with pytest.raises(SystemExit) as exit_:
            render.main()
        return exit_.value.code, capsys.readouterr().err

    code, err = run("--results", str(tmp_path / "nope"))
    assert code == 2 and "no such folder" in err
    code, err = run("--results", str(tmp_path / "empty"))
    assert code == 2 and "no *.jsonl rows there" in err
    rows = tmp_path / "rows"
    rows.mkdir()
    (rows / "pareto.jsonl").write_text('{"case": "a"}\n{"case": "int8", "row"\n')
    code, _ = run("--results", str(rows))
    assert "pareto.jsonl:2: not a JSON row" in str(code)
    assert "old" in doc.read_text()  # nothing written
    with pytest.raises(ValueError, match=r"demo.jsonl:1: a row is a JSON object"):
        (rows / "demo.jsonl").write_text("[1, 2]\n")
        utils.read_rows(rows / "demo.jsonl")


def test_render_names_the_file_case_and_field_of_a_row_missing_a_field(tmp_path, monkeypatch):
    """A row without a field a table reads failed with a bare ``KeyError: 'ppl'``, naming neither the file
    nor the row."""
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- render:compaction -->\nold\n<!-- /render:compaction -->\n")
    row = {"case": "snapkv C4096 keep0.1 cuda", "method": "snapkv", "context": 4096, "keep": 0.1,
           "ppl_full": 20.0, "held_tokens": 410, "chunks": 3, "seconds": 1.0, "remeasured": True,
           "provenance": {}}
    (tmp_path / "compaction.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setattr(sys, "argv", ["render.py", "--doc", str(doc), "--results", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        render.main()
    assert str(exit_.value.code) == ("render.py: block compaction: compaction.jsonl: the row of case "
                                     "'snapkv C4096 keep0.1 cuda' has no field 'ppl'")
    assert "old" in doc.read_text()  # nothing written


def test_benchmarks_md_is_rendered_from_the_committed_rows():
    text = render.DOC.read_text()
    assert render.render(text, render.Results(utils.RESULTS)) == text, "run: python benchmarks/render.py"
    # a results document, not a log: history goes to docs/notes/ (raised from 42 000 for §3 serving, after
    # the settled kernel questions moved to docs/notes/kernel-tries.md; to 48 000 for the capacity by
    # context and the windowed serving rows; to 50 000 for compaction at C 1024 and 7680 beside the presses)
    assert len(text.encode()) <= 50_000


def test_committed_result_files_stay_small():
    """Rows are results, not data: a file of them stays under 1 MiB (a calibration row once carried its
    per-layer profiles, 250 kB a row)."""
    big = {p.name: p.stat().st_size for p in utils.RESULTS.iterdir() if p.is_file()
           and p.stat().st_size > 1 << 20}
    assert not big, f"result files over 1 MiB: {big}"


def fake_timer(fn, **kw):
    """A timer for the CPU smoke tests: runs ``fn`` once and reports fixed percentiles."""
    fn()
    return {"p20": 1.0, "p50": 2.0, "p80": 3.0}


def test_bench_attention_shared_rows_on_the_cpu(results, monkeypatch):
    """The shared-bases table at a tiny shape (the interpreter, the timer replaced): per-head and shared
    arms in both key modes at two budgets, shared at G times the rank, each over SDPA."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the CPU smoke test; on CUDA run the script itself")
    import bench_attention as ba

    monkeypatch.setattr(utils, "graph_ms", fake_timer)
    for name, value in {"DEVICE": "cpu", "H": 4, "G": 2, "D_HEAD": 32}.items():
        monkeypatch.setattr(ba, name, value)
    ba.shared_rows([(1, 70)])
    rows = utils.read_rows(results / "attention.jsonl")
    assert len(rows) == 8 and all(r["table"] == "shared" and r["ratio_median"] == 1.0 for r in rows)
    assert {(r["bases"], r["budget"], r["r"]) for r in rows} == {
        ("per-head", "12.5%", 16), ("shared", "12.5%", 32), ("per-head", "25%", 32), ("shared", "25%", 64)}


def test_bench_attention_rows_on_the_cpu(results, monkeypatch):
    """Decode, sweep and prefill rows at tiny shapes (the kernel under the interpreter, the timers replaced):
    every row names its case, carries SDPA beside the kernel, and the renderer reads them."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the CPU smoke test; on CUDA run the script itself")
    import bench_attention as ba

    monkeypatch.setattr(utils, "graph_ms", fake_timer)
    monkeypatch.setattr(utils, "bench_ms", fake_timer)
    for name, value in {
        "DEVICE": "cpu",
        "H": 4,
        "G": 2,
        "D_HEAD": 32,
        "BUDGETS": {"50%": 16},
        "SWEEP": ba.SWEEP[:1],
        "QUANT_SWEEP": [{"prefetch": True}, {"fold_scales": True}],
    }.items():
        monkeypatch.setattr(ba, name, value)
    with torch.no_grad():
        ba.decode_rows([(1, 300)], copy=4.0)
        ba.sweep_rows([(1, 300)])
        ba.prefill_rows(n=48)
        ba.quant_rows([(1, 300)], copy=4.0)
        table = render.decode_quant(render.Results(results))
        ba.quant_rows([(1, 300)], copy=4.0, modes=["pre_rope"], rank=13)  # an odd rank (--rank)
        odd = utils.read_rows(results / "attention.jsonl")[-3:]
        ba.quant_rows([(1, 300)], copy=4.0, modes=["post_rope"], bits_list=[8], log8=True)  # --log8
        log8 = utils.read_rows(results / "attention.jsonl")[-1]
        monkeypatch.setattr(ba, "QUANT_SWEEP", [{"channel_rows": True}, {"prefetch": True}])
        ba.quant_rows([(1, 300)], copy=4.0, modes=["pre_rope"], bits_list=[2], channel_keys=True)
    channel = utils.read_rows(results / "attention.jsonl")[-1]
    assert channel["case"].endswith(" int2-channel-keys pre_rope") and channel["key_layout"] == "channel"
    assert [t["config"].get("channel_rows") for t in channel["sweep"]] == [True, None]
    assert log8["case"].endswith(" int8-log8 post_rope") and log8["log8"] and log8["kernel_ms"]["p50"] > 0
    assert render.decode_quant(render.Results(results)) == table  # log8 and channel rows stay out
    assert [r["case"] for r in odd] == [f"decode 1x300 r13 {b} pre_rope" for b in ("bf16", "int8", "int4")]
    assert all(r["r"] == 13 and r["budget"] == "r13" for r in odd)
    assert render.decode_quant(render.Results(results)) == table  # the table stays at 50 % ranks
    rows = utils.read_rows(results / "attention.jsonl")[:-5]
    assert [r["table"] for r in rows] == ["decode"] * 2 + ["sweep"] * 2 + ["prefill"] * 3 + ["quant"] * 6
    assert rows[-1]["case"] == "decode 1x300 r16 int4 pre_rope" and rows[-1]["bytes"] > 0
    assert rows[-1]["fold_scales_ms"]["p50"] == 2.0 and rows[-1]["best"]["kernel_ms"]["p50"] == 2.0
    assert rows[-6]["case"] == "decode 1x300 r16 bf16 post_rope" and rows[-6]["fold_scales_ms"] is None
    assert [t["config"].get("prefetch") for t in rows[-6]["sweep"]] == [True]
    assert "| 1×300 | bf16 | post_rope |" in render.decode_quant(render.Results(results))
    assert rows[0]["case"] == "decode 1x300 r16 post_rope" and rows[0]["sdpa_ms"]["p50"] == 2.0
    assert rows[1]["poly_sincos_ms"] is not None and rows[0]["poly_sincos_ms"] is None
    assert rows[2]["best"]["config"]["num_splits"] >= 1
    table = render.decode(render.Results(results))
    assert "| 1×300 | 50% | post_rope |" in table


def test_bench_attention_at_smollm2_heads(results, monkeypatch):
    """--heads smollm2: decode and quant rows at SmolLM2's attention shapes (9 query heads over 3 KV heads,
    d 64; GQA 3, which the kernel pads), 50 % as r 32, named so that they stay out of the Llama tables."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the CPU smoke test; on CUDA run the script itself")
    import bench_attention as ba

    monkeypatch.setattr(utils, "graph_ms", fake_timer)
    monkeypatch.setattr(utils, "bench_ms", fake_timer)
    for name in ("H", "G", "D_HEAD", "D_MODEL", "CASE_PREFIX", "TABLE_SUFFIX", "BUDGETS"):  # restored after
        monkeypatch.setattr(ba, name, getattr(ba, name))
    monkeypatch.setattr(ba, "DEVICE", "cpu")
    monkeypatch.setattr(ba, "QUANT_SWEEP", [{"splits": 2}])
    ba.set_heads("smollm2")
    with torch.no_grad():
        ba.decode_rows([(1, 70)], copy=4.0)
        ba.quant_rows([(1, 70)], copy=4.0, modes=["pre_rope"], bits_list=[4])
    rows = utils.read_rows(results / "attention.jsonl")
    assert [r["case"] for r in rows] == [f"decode smollm2 1x70 {c}" for c in (
        "r32 post_rope", "r32 pre_rope", "r16 post_rope", "r16 pre_rope", "r32 int4 pre_rope")]
    assert all((r["H"], r["G"], r["d"]) == (9, 3, 64) for r in rows[:4])
    assert [r["table"] for r in rows] == ["decode-smollm2"] * 4 + ["quant-smollm2"]
    assert all(r["kernel_ms"]["p50"] == 2.0 and r["sdpa_ms"]["p50"] == 2.0 for r in rows)
    for table in (render.decode(render.Results(results)), render.decode_quant(render.Results(results))):
        assert "smollm2" not in table and "1×70" not in table  # the shape column is parsed from the case
    assert rows[0]["target_ratio"] is None  # the Llama targets are not these shapes


def test_bench_attention_band_rows_on_the_cpu(results, monkeypatch):
    """The band table at a tiny shape (the interpreter, the timer replaced): both key modes, the default
    warps beside the sweep's, the reference's time in the same row; and the two paths agree on its inputs."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the CPU smoke test; on CUDA run the script itself")
    import bench_attention as ba

    monkeypatch.setattr(utils, "bench_ms", fake_timer)
    for name, value in {"DEVICE": "cpu", "H": 6, "G": 2, "D_HEAD": 32, "BUDGETS": {"50%": 13}}.items():
        monkeypatch.setattr(ba, name, value)
    ba.band_rows([(2, 5)], window=3)
    rows = utils.read_rows(results / "attention.jsonl")
    assert [r["case"] for r in rows] == ["band 2x5+3 r13 post_rope", "band 2x5+3 r13 pre_rope"]
    assert all(r["table"] == "band" and r["band_keys"] == 8 and r["reference_ms"]["p50"] == 2.0 for r in rows)
    assert [t["config"]["num_warps"] for t in rows[0]["sweep"]] == [8]  # beside the default 4
    assert rows[0]["config"]["num_warps"] == 4
    x, exact = ba.band_inputs(2, 5, 3, 13)
    for mode in ba.MODES:
        kw = dict(key_mode=mode, positions=x["positions"], rope=x["rope"])
        out, lse = ba.band_kernel.band_attention(x["q"], x["z_k"], x["z_v"], exact, x["P_k"], None, **kw)
        ref, ref_lse = ba.reference_attention(x["q"], x["z_k"], x["z_v"], x["P_k"], None, exact=exact,
                                              return_lse=True, **kw)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)  # bf16 inputs
        torch.testing.assert_close(lse, ref_lse, atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("recent", [0, 16])
def test_bench_serve_runs_on_a_tiny_model(recent):
    """bench_serve.py end to end on the CPU (eager, the reference): the three caches, one line each; int8
    codes alone, and behind a 16-token exact window (decode reads them beside the ring) with a
    quantization-only KIVI-2 cache (keys per channel) served beside them."""
    import subprocess

    baseline = ["--baseline-cache", "kivi2"] if recent else []
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_serve.py"), "--tiny", "--cases", "2x40",
                          "--new-tokens", "3", "--rounds", "1", "--chunk", "16", "--bits", "8",
                          "--recent", str(recent), *baseline],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    label = "int8 r16" if recent else "int8"
    assert line.startswith(f"serve tiny pre_rope 0.5 {label} B2 ctx40: transformers static"), line
    assert "StiefKV" in line
    assert ("quantization only (kivi2)" in line) == bool(recent), line
    # a progress line per served cache before the row (a case prefills them all before its first number)
    assert out.stdout.count("prefilled in") == (4 if recent else 3), out.stdout
    if recent:
        return
    # --compact: the same StiefKV cache over the prompts compacted to a quarter, served beside the others
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_serve.py"), "--tiny", "--cases", "2x40",
                          "--new-tokens", "3", "--rounds", "1", "--compact", "0.25"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("serve tiny pre_rope 0.5 B2 ctx40 keep0.25:"), line
    assert "compacted to 0.25:" in line, line
    # refused before the model is built or any cache prefilled (it took a default case's prefill before)
    bad = subprocess.run([sys.executable, str(BENCHMARKS / "bench_serve.py"), "--tiny", "--baseline-cache",
                          "kivi5"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "'kivi5' is not a baseline; choose one of int8" in bad.stderr
    assert "prefilled in" not in bad.stdout, bad.stdout


def test_served_keeps_its_attention_modules_after_unload():
    """bench_serve unloads the model right after capturing each served decode step; the step's graph reads
    the served modules' buffers (folded weights, bases) by address, so the Served object must hold them
    (they were freed under the graph before, and its replays read reused memory); an eager step (no capture)
    runs them too, and the model is left unloaded."""
    import gc
    import weakref

    import bench_serve as bs
    from transformers import LlamaConfig, LlamaForCausalLM

    import stiefkv
    from stiefkv.attention import LowRankAttention
    from stiefkv.models import decoder_layers

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**bs.TINY)).eval()
    stiefkv.load(model, bs.random_projections(model, 0.5, "pre_rope"), backend="reference")
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    served = bs.Served(model, ids, 24 + 4, 16, capture=False)
    refs = [weakref.ref(layer.self_attn) for layer in decoder_layers(model)]
    stiefkv.unload(model)
    gc.collect()
    assert all(isinstance(r(), LowRankAttention) for r in refs)
    filled = int(served.runner.cache.filled)
    served.decode_tps(2)  # eager (CPU): through the served modules, not the original attention
    assert int(served.runner.cache.filled) == filled + 2
    assert not any(isinstance(layer.self_attn, LowRankAttention) for layer in decoder_layers(model))
    del served
    gc.collect()
    assert all(r() is None for r in refs)


def _mixed_checkpoint(path, key_mode="post_rope", shared=False, layers=3, shared_ranks=None):
    """A checkpoint of a 3-layer model with head dim 16 whose layers store differently, as ``--bits auto``'s
    do: int8 log8 and int4 behind exact windows, channel-layout keys, bf16."""
    import bench_serve as bs
    from transformers import LlamaConfig, LlamaForCausalLM

    import stiefkv
    from stiefkv.models import fingerprint
    from stiefkv.quant import FLOAT, QuantSpec

    cfg = dict(bs.TINY, num_hidden_layers=layers, head_dim=16)
    source = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    g = torch.Generator().manual_seed(1)
    ranks = ([(8, 16), (16, 8), (8, 8), (8, 8)] if not shared else shared_ranks or [(24, 24)] * 4)[:layers]
    heads = (1, 32) if shared else (2, 16)
    basis = [(utils.random_basis(*heads, rk, device="cpu", generator=g),
              utils.random_basis(*heads, rv, device="cpu", generator=g)) for rk, rv in ranks]
    quant = [(QuantSpec(8, "token", recent=16, log8=True, window8=True), QuantSpec(4, "token", recent=16)),
             (QuantSpec(4, "channel", recent=16, window8=True), QuantSpec(2, "token", recent=16, log8=True)),
             (FLOAT, FLOAT), (FLOAT, FLOAT)][:layers]
    proj = stiefkv.Projections(keys=[k for k, _ in basis], values=[v for _, v in basis], key_mode=key_mode,
                               fingerprint=fingerprint(source), budget=0.3, method="test", quant=quant)
    proj.save(path)
    return proj


def test_storage_from_a_checkpoint_maps_its_ranks_and_specs(tmp_path):
    """--storage-from: each layer of the served model takes a checkpoint layer's ranks as the same fraction
    of its head dim and that layer's specs, the checkpoint's layers spread over the model's; its key mode
    unless one is asked; a clear error for a missing file. A --share-heads checkpoint gives shared bases at
    the same fraction of the layer's G·d channels."""
    import bench_serve as bs
    from transformers import LlamaConfig, LlamaForCausalLM

    ck = _mixed_checkpoint(tmp_path / "src.safetensors")
    model = LlamaForCausalLM(LlamaConfig(**bs.TINY)).eval()  # 2 layers, head dim 32
    proj = bs.storage_projections(model, str(tmp_path / "src.safetensors"))
    assert proj.ranks == [(16, 32), (32, 16)]  # checkpoint layers 0 and 1, fractions of 16 → of 32
    assert proj.specs == ck.specs[:2] and proj.key_mode == "post_rope" and proj.budget == 0.3
    fields = bs.storage_fields(proj)  # the row's record of the checkpoint, without reading it again
    assert fields["storage_from"] == "src.safetensors" and fields["storage_ranks"] == ck.ranks
    assert fields["storage_specs"] == [[str(k), str(v)] for k, v in ck.specs]
    assert fields["ranks"] == proj.ranks
    for P in proj.keys + proj.values:
        eye = torch.eye(P.shape[-1]).expand(P.shape[0], -1, -1)
        torch.testing.assert_close(P.transpose(-1, -2) @ P, eye, atol=1e-5, rtol=0)
    assert bs.storage_projections(model, str(tmp_path / "src.safetensors"), "pre_rope").key_mode == "pre_rope"
    deeper = LlamaForCausalLM(LlamaConfig(**dict(bs.TINY, num_hidden_layers=6))).eval()
    proj = bs.storage_projections(deeper, str(tmp_path / "src.safetensors"))  # 3 layers over 6: each twice
    assert proj.ranks == [(16, 32), (16, 32), (32, 16), (32, 16), (16, 16), (16, 16)]
    assert proj.specs == [ck.specs[i] for i in (0, 0, 1, 1, 2, 2)]
    _mixed_checkpoint(tmp_path / "four.safetensors", layers=4)
    proj = bs.storage_projections(model, str(tmp_path / "four.safetensors"))  # 4 layers over 2: every other
    assert proj.ranks == [(16, 32), (16, 16)]
    with pytest.raises(SystemExit, match="--storage-from: checkpoint .*nope.safetensors does not exist"):
        bs.storage_projections(model, str(tmp_path / "nope.safetensors"))
    shared = _mixed_checkpoint(tmp_path / "shared.safetensors", shared=True)  # R 24 of G·d 32
    proj = bs.storage_projections(model, str(tmp_path / "shared.safetensors"))  # G·d 64 here
    assert shared.shared and proj.shared and proj.ranks == [(48, 48), (48, 48)]
    assert all(P.shape == (1, 64, 48) for P in proj.keys + proj.values) and proj.specs == shared.specs[:2]
    for P in proj.keys + proj.values:
        torch.testing.assert_close(P[0].T @ P[0], torch.eye(48), atol=1e-5, rtol=0)
    # --key-mode auto: after RoPE where a shared layer keeps every one of its G·d key ranks
    _mixed_checkpoint(tmp_path / "whole.safetensors", shared=True, shared_ranks=[(32, 24), (24, 24), (32, 8)])
    proj = bs.storage_projections(model, str(tmp_path / "whole.safetensors"), "auto")
    assert proj.layer_key_modes == ["post_rope", "pre_rope"] and proj.ranks == [(64, 48), (48, 48)]


@pytest.mark.parametrize("shared", [False, True], ids=["per-head", "shared"])
def test_bench_serve_serves_a_checkpoints_storage(tmp_path, shared):
    """bench_serve.py --storage-from end to end on the CPU: the mixed storages (log8, channel keys, 2-bit,
    exact windows, bf16) decode, under the checkpoint's key mode and file name, per-head and shared."""
    import subprocess

    _mixed_checkpoint(tmp_path / "mixed.safetensors", shared=shared)
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_serve.py"), "--tiny", "--cases", "2x40",
                          "--new-tokens", "3", "--rounds", "1", "--chunk", "16",
                          "--storage-from", str(tmp_path / "mixed.safetensors")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("serve tiny post_rope storage mixed 0.3 B2 ctx40: transformers static"), line
    if shared:
        return
    bad = subprocess.run([sys.executable, str(BENCHMARKS / "bench_serve.py"), "--tiny", "--bits", "4",
                          "--storage-from", str(tmp_path / "mixed.safetensors")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--storage-from serves the checkpoint's ranks and storage; drop --bits" \
        in bad.stderr


def test_a_failed_warm_up_replay_names_its_cache(monkeypatch):
    """A fault inside a graph replay surfaces at the next sync, with no trace of which cache's graph ran:
    run_case's warm-up round adds its name to the error, whose type it keeps (the second served cache here,
    the uncompressed one on StiefKV's kernels)."""
    import argparse

    import bench_serve as bs
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**bs.TINY)).eval()
    calls = []

    def decode_tps(self, steps):
        calls.append(steps)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return 1.0

    monkeypatch.setattr(bs.Served, "decode_tps", decode_tps)
    args = argparse.Namespace(rounds=1, new_tokens=2, chunk=16, baseline_cache=None)
    proj = bs.random_projections(model, 0.5, "pre_rope")
    with pytest.raises(RuntimeError, match="an illegal memory access") as caught:
        bs.run_case(model, proj, 2, 24, args, torch.device("cpu"))
    assert caught.value.__notes__ == [
        "bench_serve: in the warm-up replays of the uncompressed cache on StiefKV's kernels (2x24)"]


@pytest.mark.parametrize("bits", [16, 8, "kivi2"])
def test_context_capacity_fill_is_what_a_prefill_leaves(bits):
    """bench_serve.fill_synthetic (the context-capacity trials' cache, written without a prefill) leaves the
    counters a prefill of the same length leaves, and a decode step reads it and advances them."""
    import bench_serve as bs
    from transformers import LlamaConfig, LlamaForCausalLM

    import stiefkv
    from stiefkv.quant import QuantSpec
    from stiefkv.serve import DecodeState, Runner, make_cache

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**bs.TINY)).eval()
    proj = bs.random_projections(model, 0.5, "pre_rope")
    if bits == "kivi2":  # channel-layout keys and an exact ring: --fill-first's KIVI-2 trials
        from stiefkv.evaluate import BASELINES

        proj.quant = [BASELINES["kivi2"]] * len(proj.keys)
    elif bits < 16:
        proj.quant = [(QuantSpec(bits, "token"), QuantSpec(bits, "token"))] * len(proj.keys)
    stiefkv.load(model, proj)
    try:
        runner = Runner(model, make_cache(model, 1, 40), None)
        bs.fill_synthetic(runner.cache, 33)
        assert runner.cache.seen == 33 and int(runner.cache.filled) == 33
        assert torch.equal(runner.cache.positions[0, :33], torch.arange(33, dtype=torch.int32))
        state = DecodeState(torch.zeros(1, 4, dtype=torch.long), torch.full((1, 1), 33), 33)
        with torch.inference_mode():
            logits = runner.forward(state.ids, state.positions, state.slot)
            runner.step(state)
        assert torch.isfinite(logits).all()
        assert runner.cache.seen == 35 and int(runner.cache.filled) == 35
    finally:
        stiefkv.unload(model)


def test_capacity_rows_are_written_as_each_cache_finishes(tmp_path, monkeypatch):
    """A capacity run cut short (a device call's time limit) keeps the rows of the caches it finished, each
    with its ratios to the uncompressed cache's."""
    import json

    import bench_serve as bs

    def cut_short(model, caches, args, device, emit, keeps=None):
        names = list(caches)
        emit({"cache": names[0], "batch": 5, "tokens": 5 * args.context, "tps": 400.0})
        emit({"cache": names[1], "batch": 11, "tokens": 11 * args.context, "tps": 880.0})
        raise TimeoutError("the call's limit")

    monkeypatch.setenv("STIEFKV_RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(bs, "capacity", cut_short)
    monkeypatch.setattr(sys, "argv", ["bench_serve.py", "--tiny", "--capacity", "--context", "64"])
    with pytest.raises(TimeoutError):
        bs.main()
    rows = [json.loads(line) for line in (tmp_path / "serve_capacity.jsonl").read_text().splitlines()]
    assert [r["batch"] for r in rows] == [5, 11]
    assert rows[1]["capacity_ratio"] == pytest.approx(2.2) and rows[1]["tps_ratio"] == pytest.approx(2.2)
    assert rows[0]["tps_ratio"] == 1.0 and rows[0]["case"] == rows[1]["case"]
    assert rows[0]["provenance"]["run_id"] == rows[1]["provenance"]["run_id"]


def test_capacity_search_finds_the_boundary_and_starts_stiefkv_where_asked(monkeypatch):
    """The capacity search ends on a batch that ran with the next one refused, from the batch the peaks of
    1 and 2 rows predict or, for StiefKV's caches only, from ``--start-batch``, and for the baseline from
    ``--baseline-start-batch`` (above or below the answer)."""
    import argparse
    import types

    import bench_serve as bs

    fits = {"base": 5, "ours": 43, "kivi": 30}
    tried = {name: [] for name in fits}
    keeps = []

    def trial(model, proj, B, N, args, device, keep=None):
        tried[proj].append(B)
        keeps.append((proj, B, keep))
        if B > fits[proj]:
            return None
        return {"batch": B, "tps": 10.0 * B, "peak_gib": 4.0 * B / fits[proj], "cache_gib": 0.0}

    cuda = types.SimpleNamespace(current_device=lambda: 0, memory_allocated=lambda: 0,
                                 set_per_process_memory_fraction=lambda *a: None,
                                 get_device_properties=lambda i: types.SimpleNamespace(total_memory=2**40))
    monkeypatch.setattr(bs, "trial", trial)
    monkeypatch.setattr(bs.torch, "cuda", cuda)
    for start, base_start in ((None, None), (47, None), (40, 33), (40, 12)):
        for name in tried:
            tried[name].clear()
        args = argparse.Namespace(cap_gib=4.0, context=32768, start_batch=start,
                                  baseline_start_batch=base_start)
        caches = {"uncompressed (our kernels)": "base", "stiefkv 0.4375 int4": "ours",
                  "quantization only: kivi2": "kivi"}
        rows = bs.capacity(None, caches, args, "cuda")
        assert [(r["batch"], r["refused_batch"]) for r in rows] == [(5, 6), (43, 44), (30, 31)], start
        assert tried["base"][:2] == [1, 2]
        assert (tried["ours"][0] == start) if start else (tried["ours"][:2] == [1, 2])
        assert (tried["kivi"][0] == base_start) if base_start else (tried["kivi"][:2] == [1, 2])
    # a cache of compacted prompts (--compact): its trials take its keep, and its search starts from its own
    # peaks (--start-batch is the uncompacted StiefKV cache's)
    keeps.clear()
    compacted = {"uncompressed (our kernels)": "base", "compacted to 0.1: stiefkv 0.5": "kivi"}
    args = argparse.Namespace(cap_gib=4.0, context=32768, start_batch=47, baseline_start_batch=None)
    rows = bs.capacity(None, compacted, args, "cuda", keeps={"compacted to 0.1: stiefkv 0.5": 0.1})
    assert [r["batch"] for r in rows] == [5, 30]
    assert {k for p, _, k in keeps if p == "kivi"} == {0.1}
    assert {k for p, _, k in keeps if p == "base"} == {None}
    assert [b for p, b, _ in keeps if p == "kivi"][:2] == [1, 2]
    fits["ours"] = 0  # nothing fits: a row that says so, from either start
    for start in (None, 3):
        args = argparse.Namespace(cap_gib=4.0, context=32768, start_batch=start)
        assert bs.capacity(None, caches, args, "cuda")[1]["batch"] == 0


@pytest.mark.parametrize("seed", range(4))
def test_capacity_boundary_search_gallops_and_bisects(seed):
    """``boundary`` finds the largest batch that fits from any start, far above or below it, resting on a
    batch that ran with the next one refused, in a number of trials logarithmic in the distance (a KIVI-2
    trial at 27 rows of 32k ran 213 s before running out of memory)."""
    import math
    import random

    import bench_serve as bs

    rng = random.Random(seed)
    for _ in range(50):
        fit = rng.choice([0, 1, 2, rng.randint(3, 200)])
        start = rng.randint(1, 250)
        runs = {}
        answer = bs.boundary(lambda b: {"batch": b} if b <= fit else None, runs, start)
        assert answer == fit, (fit, start)
        assert (fit == 0 or runs[fit] is not None) and runs[fit + 1] is None
        assert len(runs) <= 2 * math.log2(abs(start - fit) + 1) + 3, (fit, start, sorted(runs))


def test_filled_capacity_trials_prefill_the_last_two_forwards(monkeypatch):
    """``--fill-first``: a trial writes all but its last two prefill forwards' tokens directly and prefills
    the rest behind them, at their positions; a batch whose two forwards cover the context prefills all."""
    import argparse

    import bench_serve as bs
    from bench_generate import random_projections

    import stiefkv
    from stiefkv.serve import Runner
    from tests.tiny import tiny_model

    args = argparse.Namespace(fill_first=True, chunk=12)
    assert bs.filled_first(3, 40, args) == 40 - 8 and bs.filled_first(1, 20, args) == 0
    assert bs.filled_first(3, 40, argparse.Namespace(chunk=12)) == 0
    model = tiny_model("llama", heads=6, kv_heads=2, head_dim=24)
    stiefkv.load(model, random_projections(model, 0.5, "post_rope"))
    calls = []
    forward = Runner.forward
    monkeypatch.setattr(Runner, "forward", lambda self, ids, pos, slots: calls.append(pos[0].tolist())
                        or forward(self, ids, pos, slots))
    ids = torch.randint(2, 97, (3, 40))
    served = bs.Served(model, ids, 48, 12, False, bs.filled_first(3, 40, args))
    assert calls[:2] == [list(range(32, 36)), list(range(36, 40))]
    cache = served.runner.cache  # the prompt and the one eager decode step Served runs without capture
    assert cache.seen == 41 and int(cache.filled) == 41 and len(calls) == 3
    assert cache.positions[:, :41].eq(torch.arange(41)).all()
    assert served.logits.isfinite().all()


def test_capacity_claims_read_the_batch_runs_not_the_context_runs(tmp_path):
    """A newer context-capacity run with the same cache labels leaves the 32k batch claims on the batch run;
    a cache that fits nowhere renders as such."""
    import json
    import shutil

    shutil.copy(utils.RESULTS / "serve_capacity.jsonl", tmp_path / "serve_capacity.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "serve_capacity.jsonl").read_text().splitlines()]
    newest = [r for r in rows if r["cache"] == "stiefkv 0.4375 int4" and "refused_batch" in r][-1]
    base = next(r for r in rows if r["provenance"]["run_id"] == newest["provenance"]["run_id"]
                and r["cache"] != newest["cache"])
    fake = []
    for r, tokens in ((base, 200_000), (newest, 0)):
        row = dict(r, case="capacity-context 8b pre_rope 0.4375 int4 B1 cap40", batch=1, tokens=tokens,
                   context=tokens, capacity_ratio=None, tps_ratio=None,
                   provenance=dict(r["provenance"], run_id="later"))
        row.pop("refused_batch")
        row["refused_context"] = tokens + 4096
        fake.append(row)
    with open(tmp_path / "serve_capacity.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in fake)
    res = render.Results(tmp_path)
    claims = render.claims(res)
    expected = f"{newest['capacity_ratio']:.2f}× ({newest['batch']} vs {base['batch']} rows)"
    assert expected in claims
    assert "none fits" in render.serve_capacity(render.Results(tmp_path))


def test_capacity_claims_at_50_percent_keep_each_key_mode_on_its_own_run(tmp_path):
    """A newer 50 % run with ``post_rope`` keys gets claims of its own; the ``pre_rope`` claims keep reading
    the ``pre_rope`` run (before, the newest 50 % run of either mode took the unqualified claim)."""
    import json
    import shutil

    shutil.copy(utils.RESULTS / "serve_capacity.jsonl", tmp_path / "serve_capacity.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "serve_capacity.jsonl").read_text().splitlines()]
    pre = [r for r in rows if r["cache"] == "stiefkv 0.5" and r["case"].startswith("capacity ")
           and r.get("key_mode", "pre_rope") == "pre_rope"][-1]
    post = [dict(r, key_mode="post_rope", tps_ratio=r["tps_ratio"] + 0.31, case="capacity 8b post_rope",
                 provenance=dict(r["provenance"], run_id="newer-post")) for r in rows
            if r["provenance"]["run_id"] == pre["provenance"]["run_id"]]
    with open(tmp_path / "serve_capacity.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in post)
    claims = render.claims(render.Results(tmp_path))
    lines = claims.splitlines()
    line = next(x for x in lines if x.startswith("| … decode tok/s at each one's capacity, 50 % /"))
    assert f"| {pre['tps_ratio']:.2f}× |" in line
    line = next(x for x in claims.splitlines() if "capacity, 50 %, `post_rope` keys" in x)
    assert f"| {pre['tps_ratio'] + 0.31:.2f}× |" in line


def test_serving_claims_read_the_newest_row_under_either_case_name(tmp_path):
    """The 8×16k serving claims take the newest 50 % row of each key mode, whether its case name carries
    the budget (since 2026-12-02) or not (before): an older-named row appended later wins, and back."""
    import json
    import shutil

    shutil.copy(utils.RESULTS / "serve.jsonl", tmp_path / "serve.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "serve.jsonl").read_text().splitlines()]
    newest = [r for r in rows if r["case"] == "serve 8b post_rope 0.5 B8 ctx16384"][-1]
    def claim_line():
        claims = render.claims(render.Results(tmp_path)).splitlines()
        return next(x for x in claims if "`post_rope` keys / the" in x)

    line = claim_line()
    assert f"| {newest['ratio_median']:.2f}× |" in line
    later = dict(newest, case="serve 8b post_rope B8 ctx16384", ratio_median=0.5,
                 provenance=dict(newest["provenance"], date="2099-01-01 00:00:00 UTC"))
    with open(tmp_path / "serve.jsonl", "a") as f:
        f.write(json.dumps(later) + "\n")
    line = claim_line()
    assert "| 0.50× |" in line and "missed" in line


def test_runs_table_names_each_file_machine_and_commit_of_the_rows_used(tmp_path):
    """The provenance table: one line for the one file, machine and versions the rendered rows came from,
    with its commit; a row no table used is not counted."""
    import json

    prov = {"commit": "abc1234", "date": "2026-12-03 00:00:00 UTC", "gpu": {"name": "NVIDIA H200"}}
    row = {"bench": "pareto", "row": "int8", "budget": None, "ppl": 22.0, "ppl_original": 21.97,
           "next_token_kl": 0.0001, "bytes_fraction": 0.53, "kv_bytes_per_token": 12328, "remeasured": True,
           "provenance": prov}
    unused = dict(row, case="nothing reads this", provenance=dict(prov, commit="fff0000"))
    rows = [dict(row, case="int8"), unused]
    (tmp_path / "pareto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = render.Results(tmp_path)
    assert "| int8 per token (quantization only) | 53.00 % |" in render.pareto(res)
    lines = render.runs(res).splitlines()[2:]
    assert len(lines) == 1 and lines[0].startswith("| `pareto.jsonl` | 1 | 2026-12-03 | H200 | `abc1234` |")


def test_bench_pareto_resolves_key_mode_auto_as_calibrate_does(tmp_path):
    """The Pareto runner's shared first pass and its allocation + second pass give what ``stiefkv.calibrate``
    gives for ``key_mode="auto"``: keys served after RoPE at full rank (bases from the rotated keys), before
    it where a rank is cut; not a checkpoint that says ``auto``."""
    import bench_pareto

    import stiefkv
    from stiefkv.calibrate.pipeline import CalibrationConfig
    from tests.tiny import tiny_model

    seqs = torch.randint(0, 97, (6, 23), generator=torch.Generator().manual_seed(3))
    kw = {"method": "pca", "bits": "16", "allocation": "uniform", "key_mode": "auto", "device": "cpu"}
    for budget, served in ((1.0, "post_rope"), (0.5, "pre_rope")):
        model = tiny_model(layers=2)
        cfg = CalibrationConfig.from_kwargs(budget=budget, **kw)
        path = tmp_path / f"first{budget}.safetensors"
        first, _ = bench_pareto.first_pass_state(model, seqs, cfg, path, "cpu")
        proj, _ = bench_pareto.calibrated(model, seqs, first, cfg, "cpu")
        ref = stiefkv.calibrate(model, None, sequences=seqs, budget=budget,
                                **{k: v for k, v in kw.items() if k != "device"})
        assert proj.key_mode == ref.key_mode == served
        for a, b in zip(proj.keys, ref.keys):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_bench_serve_decode_options_override_decode_only(monkeypatch):
    """``--decode-option KEY=VALUE`` (a same-run A/B of a kernel option end to end): parsed as a bool or an
    int, refused with the options' names when unknown, applied to decode launches over codes and not to
    prefill or float latents, and named in the case."""
    import argparse

    import bench_serve as bs

    from stiefkv.kernels import lowrank

    assert bs.decode_option("pairs=false") == ("pairs", False)
    assert bs.decode_option("block_n=64") == ("block_n", 64)
    for bad in ("pairs", "pairs=maybe", "=3"):
        with pytest.raises(argparse.ArgumentTypeError, match="pairs=false|integer"):
            bs.decode_option(bad)
    monkeypatch.setattr(lowrank, "_default_config", lowrank._default_config)
    with pytest.raises(SystemExit, match="pair: not a decode option"):
        bs.override_decode({"pair": False})
    bs.override_decode({"pairs": False, "block_n": 32})
    decode = lowrank._default_config(4, 4096, "post_rope", 16, 132, 128, True, 8)
    prefill = lowrank._default_config(400, 4096, "post_rope", 16, 132, 128, True, 8)
    assert decode["pairs"] is False and decode["block_n"] == 32 and decode["prefetch"]
    assert "pairs" not in prefill and prefill["block_n"] == 64
    floats = lowrank._default_config(4, 4096, "post_rope", 16, 132, 128, False, 16)  # the uncompressed cache
    assert floats["block_n"] == 64 and not floats["pairs"]
    args = argparse.Namespace(storage_from=None, budget=1.0, bits=8, recent=16,
                              decode_option={"pairs": False})
    assert bs.cache_label(args) == "stiefkv 1 int8 r16 pairs=False"


def test_calibration_keywords_parse_and_refuse():
    """``--extra`` of the calibration benchmarks: bools, integers and numbers parsed as the settings take
    them (``kernel_storage=false`` was the truthy string ``'false'``, ``lr=1e-3`` a string), and a bad
    setting refused with its name before any model is built."""
    got = utils.calibration_keywords("steps=20,lr=1e-3,kl_weight=-0,method=pca,kernel_storage=false,bits=16")
    assert got == dict(steps=20, lr=1e-3, kl_weight=0.0, method="pca", kernel_storage=False, bits=16)
    assert isinstance(got["steps"], int) and got["kernel_storage"] is False
    assert utils.calibration_keywords("") == {}
    for text, message in [("steps=20,method", "'method' is not NAME=VALUE"),
                          ("rank=3", "unknown calibration"), ("steps=-1", "steps ≥ 0"),
                          ("method=svd", "method must be one of"),
                          ("share_heads=maybe", "share_heads must be True or False")]:
        with pytest.raises(SystemExit, match=message):
            utils.calibration_keywords(text)


@pytest.mark.parametrize("argv, message", [
    (["--cases", "2x64", "2by64"], "'2by64': expected BATCHxCONTEXT"),
    (["--cases", "0x64"], "'0x64': expected BATCHxCONTEXT"),
    (["--rounds", "0"], "--rounds: 0 is below 1"),
    (["--new-tokens", "0"], "--new-tokens: 0 is below 1"),
    (["--chunk", "-4"], "--chunk: -4 is below 1"),
    (["--code-slice", "x"], "--code-slice: 'x' is not an integer"),
    (["--budget", "1.5"], "--budget must be in (0, 1]"),
    (["--cap-gib", "0"], "--cap-gib must be above 0"),
    (["--storage-from", "no/such.safetensors"], "no such checkpoint file"),
    (["--baseline-cache", "kivi5"], "'kivi5' is not a baseline"),
    (["--fill-first"], "--fill-first tune the --capacity search"),
    (["--decode-option", "pairs=false"], "--decode-option changes decode over codes; this run serves none"),
])
def test_bench_serve_refuses_bad_arguments_before_any_work(argv, message, monkeypatch, capsys):
    """bench_serve's arguments are checked as they are parsed: a typo in the last of several cases, or a
    round count of 0, no longer waits for a model to be built and the first cases' prefill (minutes on a
    GPU)."""
    import bench_serve as bs

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(bs, "LlamaForCausalLM", no_model)
    monkeypatch.setattr(sys, "argv", ["bench_serve.py", "--tiny", *argv])
    with pytest.raises(SystemExit) as exit_:
        bs.main()
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_serve_refuses_decode_option_values_the_kernel_cannot_take(monkeypatch):
    """``--decode-option block_n=48`` is refused with the values the kernel takes, before any model is built
    (it was a Triton compile error after the prefill)."""
    import bench_serve as bs

    from stiefkv.kernels import lowrank

    monkeypatch.setattr(lowrank, "_default_config", lowrank._default_config)  # restored after the test
    for option, message in [({"block_n": 48}, "block_n=48: the kernel takes block_n of 16, 32, 64, 128, 256"),
                            ({"num_warps": 3}, "num_warps=3"), ({"num_splits": 0}, "num_splits of 1 to 1024"),
                            ({"pair": True}, "pair: not a decode option")]:
        with pytest.raises(SystemExit, match=message):
            bs.override_decode(option)


@pytest.mark.parametrize("script, argv, message", [
    ("bench_attention", ["--sweep-with", "int3_plane"], "--sweep-with int3_plane: not an option"),
    ("bench_attention", ["--rank", "200"], "--rank 200 is above the head dimension"),
    ("bench_attention", ["--shapes", "2x64", "2by64"], "'2by64': expected BATCHxCONTEXT"),
    ("bench_generate", ["--tiny", "--rounds", "0"], "--rounds: 0 is below 1"),
    ("bench_generate", ["--tiny", "--budget", "0"], "--budget: 0 is not in (0, 1]"),
    ("bench_compaction", ["m", "--methods", "am,snapk"], "snapk: choose among"),
    ("bench_compaction", ["m", "--variants", "am_omp,am_bogus"], "am bogus: choose among"),
    ("bench_compaction", ["m", "--task", "retrieval", "--projections", "p.safetensors"], "drop one of them"),
    ("bench_compaction_speed", ["--lengths", "4096,8k"], "'8k' is not an integer"),
    ("bench_compaction_speed", ["--repeat", "0"], "--repeat: 0 is below 1"),
    ("bench_quality", ["--key-modes", "pre_rope,post_rop"], "key_mode must be one of"),
    ("bench_quality", ["--extra", '{"kernel_storage": "false"}'], "kernel_storage must be True or False"),
    ("bench_quality", ["--json", "/no/such/folder/x.json"], "its folder does not exist"),
    ("bench_quality", ["--json", "/"], "a folder, not a file"),
    ("quality_table", ["m", "out", "--rows", "pca-dp,stiefel"], "stiefel: choose among"),
    ("quality_table", ["m", "out", "--budgets", "0.5,O.25"], "'O.25' is not a number"),
    ("bench_pareto", ["m", "out", "--baselines", "kivi4,kivi5"], "--baselines kivi5: choose among"),
    ("bench_pareto", ["m", "out", "--extra", '{"steps": -1}'], "need steps ≥ 0"),
    ("bench_pareto", [], "give MODEL and OUTDIR"),
])
def test_benchmarks_refuse_bad_arguments_before_any_work(script, argv, message, monkeypatch, capsys):
    """A benchmark's arguments are checked before its model loads or its first case runs: a typo in the last
    of several methods, budgets or key modes failed after the entries before it had run (hours for the
    quality tables), a bad sweep name filtered the sweep to nothing silently, and --rounds 0 ended in a
    StatisticsError after the warm-up."""
    import importlib

    import stiefkv

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(stiefkv, "load_model", no_work)
    monkeypatch.setattr(utils, "copy_tbs", no_work)
    module = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err



@pytest.mark.parametrize("script, argv", [
    ("bench_quality", ["m", "--windows", "1"]),
    ("bench_compaction", ["m", "--chunks", "1"]),
    ("bench_compaction_speed", []),
    ("bench_calibrate_speed", []),
])
def test_benchmarks_refuse_a_results_folder_that_is_a_file_before_any_work(script, argv, tmp_path,
                                                                           monkeypatch, capsys):
    """``STIEFKV_RESULTS_DIR`` naming a file failed in ``write_rows`` with FileExistsError, after the
    measurement (bench_quality: after the uncompressed pass); a folder under a file, the same."""
    import importlib

    import stiefkv

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the results folder was checked")

    monkeypatch.setattr(stiefkv, "load_model", no_work)
    module = importlib.import_module(script)
    (tmp_path / "afile").write_text("")
    for folder, said in ((tmp_path / "afile", "which is a file"), (tmp_path / "afile" / "sub", "a file")):
        monkeypatch.setenv("STIEFKV_RESULTS_DIR", str(folder))
        monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
        with pytest.raises(SystemExit) as exit_:
            module.main()
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert said in err and str(folder) in err
    monkeypatch.setenv("STIEFKV_RESULTS_DIR", str(tmp_path / "new" / "folder"))
    assert utils.check_results_dir() == tmp_path / "new" / "folder"  # one that can be made passes
    assert not (tmp_path / "new").exists()  # and is made only when a row is written


@pytest.mark.parametrize("script, argv", [
    ("bench_quality", ["smollm3", "--windows", "1"]),
    ("bench_pareto", ["smollm3", "OUT", "--rows", "baselines"]),
    ("bench_compaction", ["smollm3", "--chunks", "1"]),
    ("quality_table", ["smollm3", "OUT"]),
    ("bench_calibrate_speed", ["--model", "smollm3", "--device", "cpu"]),
])
def test_benchmarks_say_in_one_line_that_a_model_cannot_be_loaded(script, argv, results, monkeypatch, capsys):
    """A mistyped model ended in ModelLoadError's traceback (its message was clear): now that one line,
    exit 2, as the ``stiefkv`` command says it."""
    import importlib

    module = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *[str(results / "out") if a == "OUT" else a
                                                        for a in argv]])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"{script}.py: error: model 'smollm3' is neither an alias nor a "
                                        "local path: did you mean 'smollm2'? (aliases: smollm2)"]


@pytest.mark.parametrize("script, shown", [
    ("bench_quality", ["--num-sequences NUM_SEQUENCES", "(default: 64)", "(default: pre_rope,post_rope)",
                       "(default: smollm2)", "hours on a 2-core CPU", "--windows 2"]),
    ("bench_pareto", ["(default: 0.5,0.25,0.1875", "(default: cuda where available, else cpu)"]),
    ("bench_compaction", ["(default: 512)", "(default: 4096)", "(default: 0.1)", "(default: 0)"]),
    ("bench_streamkl", ["(default: [8, 32])", "(default: 300.0)"]),
    ("quality_table", ["(default: pre_rope)", "(default: 0.5,0.75,0.375,0.25)"]),
])
def test_benchmark_help_shows_the_defaults(script, shown, monkeypatch, capsys):
    """``--help`` left most defaults out (bench_quality's all of them, and what a plain run costs)."""
    import importlib

    module = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        module.main()
    out = capsys.readouterr().out
    assert [s for s in shown if s not in out] == []
    assert "(default: )" not in out and "(default: None)" not in out and "(default: [])" not in out


def test_bench_quality_uncompressed_row_names_the_tag_and_no_backend(results, monkeypatch):
    """Two tagged runs wrote one uncompressed case (it left --tag out), and the row recorded the --backend
    of the compressed rows, which the uncompressed pass never used."""
    import importlib
    import types

    import stiefkv

    bq = importlib.import_module("bench_quality")

    def evaluate(model, tok, proj, **kwargs):
        r = types.SimpleNamespace(ppl=22.0, ppl_original=21.0, windows=1, tokens_scored=2047,
                                  kv_bytes_per_token_original=23040.0, kv_bytes_per_token=11520.0,
                                  layer_rel_error=0.1, next_token_kl=0.01)
        r.as_dict = lambda: {"ppl": r.ppl, "ppl_original": r.ppl_original}
        return r

    monkeypatch.setattr(stiefkv, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(stiefkv, "calibrate", lambda *a, **k: types.SimpleNamespace(ranks=[(32, 32)]))
    monkeypatch.setattr(bq, "evaluate", evaluate)
    for argv in ([], ["--tag", "a"], ["--tag", "b"]):
        monkeypatch.setattr(sys, "argv", ["bench_quality.py", "smollm2", "--budgets", "0.5", "--key-modes",
                                          "pre_rope", "--windows", "1", "--device", "cpu", *argv])
        bq.main()
    rows = utils.read_rows(results / "quality.jsonl")
    assert [(r["case"], r.get("backend")) for r in rows] == [
        ("smollm2 uncompressed w1", None), ("smollm2 pre_rope 0.5 pca uniform w1", "reference"),
        ("smollm2 uncompressed w1 a", None), ("smollm2 pre_rope 0.5 pca uniform w1 a", "reference"),
        ("smollm2 uncompressed w1 b", None), ("smollm2 pre_rope 0.5 pca uniform w1 b", "reference")]


def test_bench_generate_names_a_budget_other_than_the_claims_in_its_case():
    """The claims read ``generate pre_rope B1 ctx32768 new64`` as the 50 % cache; the case did not name the
    budget, so a ``--budget 0.25`` run replaced the 50 % row there."""
    import argparse

    import bench_generate

    args = argparse.Namespace(key_mode="pre_rope", batch=1, context=32768, new_tokens=64, budget=0.5)
    assert bench_generate.case_of(args) == "generate pre_rope B1 ctx32768 new64"  # the committed rows' case
    args.budget = 0.25
    assert bench_generate.case_of(args) == "generate pre_rope B1 ctx32768 new64 budget0.25"


def test_bench_pareto_keeps_a_windows_subset_apart_from_the_whole_test_set(tmp_path, monkeypatch, capsys):
    """A ``--windows N`` run wrote its baseline rows under the whole test set's case (``int8``), so render
    and the plot could take them for it, and a run resumed into the same folder with another ``--windows``
    skipped them silently (the skip read row, budget and tag only)."""
    import importlib
    import types

    import stiefkv
    import stiefkv.data
    import stiefkv.evaluate

    bp = importlib.import_module("bench_pareto")
    scored = []

    def evaluate(model, tok, proj, *, limit, **kwargs):
        scored.append(limit)
        n = limit or 147
        return types.SimpleNamespace(ppl=22.0, ppl_original=21.97, next_token_kl=0.01, windows=n,
                                     tokens_scored=2047 * n)

    proj = types.SimpleNamespace(keys=[torch.zeros(3, 64, 64)] * 2, kv_bytes_per_token=lambda: 1000.0,
                                 achieved_budget=1.0, ranks=[(64, 64)] * 2, specs=[("int8", "int8")] * 2,
                                 key_mode_summary="pre_rope")
    monkeypatch.setattr(stiefkv, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(stiefkv.evaluate, "evaluate", evaluate)
    monkeypatch.setattr(stiefkv.evaluate, "baseline_projections", lambda model, name: proj)
    monkeypatch.setattr(stiefkv.data, "calibration_sequences", lambda *a, **k: None)

    def run(*argv):
        monkeypatch.setattr(sys, "argv", ["bench_pareto.py", "m", str(tmp_path), "--rows", "baselines",
                                          "--baselines", "int8", "--device", "cpu", *argv])
        bp.main()

    run("--windows", "2")
    run("--windows", "2")  # resumed: skipped, and said so
    assert "int8 w2 cpu: already in" in capsys.readouterr().out
    run()  # the whole test set: not the subset's row
    run("--windows", "3")
    rows = utils.read_rows(tmp_path / "pareto.jsonl")
    assert [(r["case"], r["windows_limit"]) for r in rows] == [("int8 w2 cpu", 2), ("int8", None),
                                                                ("int8 w3 cpu", 3)]
    assert scored == [2, None, 3]
    # the plot reads the whole set's rows where there are any, and says how many windows they are
    assert [r["case"] for r in bp.whole_set(rows)] == ["int8"]
    assert [r["case"] for r in bp.whole_set(rows[::2])] in (["int8 w2 cpu"], ["int8 w3 cpu"])
    # render's auto rows: a subset's row does not stand in for the default's
    auto = {"case": "auto 0.5 w2 cpu", "row": "auto", "budget": 0.5, "windows_limit": 2, "storage": [],
            "remeasured": True, "provenance": {}}
    (tmp_path / "pareto.jsonl").write_text(json.dumps(auto) + "\n")
    assert render.auto_default(render.Results(tmp_path), 0.5) is None
    whole = auto | {"case": "auto 0.5", "windows_limit": None}
    (tmp_path / "pareto.jsonl").write_text(json.dumps(whole) + "\n")
    assert render.auto_default(render.Results(tmp_path), 0.5)["case"] == "auto 0.5"


def test_bench_pareto_says_a_ranks_budget_below_the_floor_and_builds_no_sequences_for_baselines(
        tmp_path, monkeypatch, capsys):
    """A ``ranks`` budget below the bf16 floor (one rank step per latent) was skipped without a word, and the
    calibration sequences were built even where no row calibrates (``--rows baselines``)."""
    import importlib
    import types

    import stiefkv
    import stiefkv.data
    import stiefkv.evaluate

    bp = importlib.import_module("bench_pareto")
    built = []
    proj = types.SimpleNamespace(keys=[torch.zeros(3, 64, 64)] * 2, kv_bytes_per_token=lambda: 1000.0,
                                 achieved_budget=0.25, ranks=[(16, 16)] * 2, specs=[("bf16", "bf16")] * 2,
                                 key_mode_summary="pre_rope")
    result = types.SimpleNamespace(ppl=22.0, ppl_original=21.97, next_token_kl=0.01, windows=1,
                                   tokens_scored=2047)
    monkeypatch.setattr(stiefkv, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(stiefkv.evaluate, "evaluate", lambda *a, **k: result)
    monkeypatch.setattr(stiefkv.evaluate, "baseline_projections", lambda model, name: proj)
    monkeypatch.setattr(stiefkv.data, "calibration_sequences", lambda *a, **k: built.append(1))
    monkeypatch.setattr(bp, "first_pass_state",
                        lambda *a: (types.SimpleNamespace(eig_k=[torch.zeros(3, 64, 64)]), 1.0))
    monkeypatch.setattr(bp, "calibrated", lambda *a: (proj, 1.0))

    def run(*argv):
        monkeypatch.setattr(sys, "argv", ["bench_pareto.py", "m", str(tmp_path), "--device", "cpu",
                                          "--windows", "1", *argv])
        bp.main()

    run("--rows", "baselines", "--baselines", "int8")
    assert built == []
    run("--rows", "ranks", "--budgets", "0.25,0.0625")
    assert built == [1]
    assert "ranks 0.0625 w1 cpu: below bf16 latents' floor 0.125" in capsys.readouterr().out
    assert [r["case"] for r in utils.read_rows(tmp_path / "pareto.jsonl")] == ["int8 w1 cpu",
                                                                               "ranks 0.25 w1 cpu"]


def test_quality_table_resumes_by_case_model_and_windows(tmp_path, monkeypatch, capsys):
    """The committed rows (some without a case, none with a model) still count as done for the whole test
    set; a ``--windows N`` run's rows are their own case and are not skipped for the whole set's (the skip
    read row, budget and tag only, and the rows did not name their model)."""
    import importlib
    import shutil
    import types

    import stiefkv

    qt = importlib.import_module("quality_table")
    shutil.copy(utils.RESULTS / "issue3-table-pre_rope.jsonl", tmp_path / "pre_rope.jsonl")
    ran = []

    def run_row(model, tok, seqs, first, cfg, device, windows):
        ran.append((cfg.budget, cfg.method, windows))
        proj = types.SimpleNamespace(achieved_budget=0.5, ranks=[(32, 32)])
        result = types.SimpleNamespace(ppl=40.0, ppl_original=20.0, windows=windows or 147, tokens_scored=1,
                                       next_token_kl=0.5)
        return proj, result, 1.0, types.SimpleNamespace(errors=[{"rel_error": 0.1}], refine=[])

    monkeypatch.setattr(stiefkv, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(qt, "calibration_sequences", lambda *a, **k: None)
    monkeypatch.setattr(qt, "load_or_run_first_pass", lambda *a, **k: (None, 1.0))
    monkeypatch.setattr(qt, "run_row", run_row)

    def run(*argv):
        monkeypatch.setattr(sys, "argv", ["quality_table.py", "m", str(tmp_path), "--device", "cpu", *argv])
        qt.main()

    run()  # every row of the default table is committed
    assert ran == []
    run("--windows", "2", "--budgets", "0.5", "--rows", "pca-uniform")
    run("--windows", "2", "--budgets", "0.5", "--rows", "pca-uniform")
    assert ran == [(0.5, "pca", 2)]
    assert "pre_rope 0.5 pca-uniform w2 cpu: already in" in capsys.readouterr().out
    run("--windows", "2", "--budgets", "0.5", "--rows", "pca-uniform")
    monkeypatch.setattr(sys, "argv", ["quality_table.py", "other", str(tmp_path), "--device", "cpu",
                                      "--windows", "2", "--budgets", "0.5", "--rows", "pca-uniform"])
    qt.main()  # another model's row is not this one's
    assert ran == [(0.5, "pca", 2)] * 2
    last = utils.read_rows(tmp_path / "pre_rope.jsonl")[-1]
    assert (last["case"], last["model"], last["windows_limit"]) == (
        "pre_rope 0.5 pca-uniform w2 cpu", "other", 2)


def test_count_prefill_ops_counts_the_python_side_of_the_gpu_path():
    """``count_prefill_ops.py`` on tiny shapes: the kernels stubbed under the interpreter, the prefill's
    operators by function, the cache's kernel-written writes among them (``write_many``); without the
    interpreter it refuses, naming the variable to set."""
    import os
    import subprocess

    script = str(BENCHMARKS / "experiments" / "count_prefill_ops.py")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, script, "--shape", "tiny", "--context", "90", "--tokens", "40"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    head, rows = out.stdout.split("\n", 1)
    total = int(head.split(": ")[1].split()[0])
    counts = {line.split("`")[1]: int(line.split("|")[2]) for line in rows.splitlines()
              if line.startswith("| `")}
    assert counts["static_cache.py: write_many"] > 0 and 0 < sum(counts.values()) <= total, out.stdout
    env.pop("TRITON_INTERPRET")
    bad = subprocess.run([sys.executable, script, "--shape", "tiny"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert bad.returncode == 2 and "set TRITON_INTERPRET=1" in bad.stderr


@pytest.mark.parametrize("script, argv, message", [
    ("fp8_quality", ["m", "--baselines", "int8", "int9"], "invalid choice: 'int9'"),
    ("fp8_quality", ["m", "--budgets", "0.5", "1.5"], "1.5 is not in (0, 1]"),
    ("fp8_quality", ["m", "--extra", "steps=20,lr"], "'lr' is not NAME=VALUE"),
    ("kernel_storage_ab", ["--budgets", "0.125,0,25"], "0 is not in (0, 1]"),
    ("kernel_storage_ab", ["--windows", "0"], "--windows: 0 is below 1"),
    ("exact_sink", ["m", "kivi2", "kivi9"], "kivi9: neither a checkpoint"),
    ("exact_sink", ["m", "kivi2", "/no/such.safetensors"], "/no/such.safetensors: no such checkpoint file"),
    ("exact_sink", ["m", "kivi2", "--sinks", "0,1,-4"], "-4 is below 0"),
])
def test_cpu_experiments_refuse_bad_arguments_before_any_work(script, argv, message, monkeypatch, capsys):
    """The CPU-only experiments check their lists before the model loads: a typo in the last budget, baseline
    or cache used to fail after the entries before it had been calibrated and scored."""
    import importlib

    import stiefkv

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(stiefkv, "load_model", no_work)
    monkeypatch.syspath_prepend(str(BENCHMARKS / "experiments"))
    module = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    # argparse's refusals exit 2 with the message on stderr; --extra's exit with the message itself
    said = capsys.readouterr().err if exit_.value.code == 2 else str(exit_.value.code)
    assert message in said


def test_ablate_decode_builds_every_variant(tmp_path, monkeypatch):
    """``ablate_decode.py`` builds its variants by replacing lines of the kernel's source; a kernel edit
    that changes one of those lines stopped the script before anything ran (the sin/cos line, when
    ``sincos_fadd`` gave ``_sincos_fast`` a second argument)."""
    import importlib

    monkeypatch.syspath_prepend(str(BENCHMARKS / "experiments"))
    ablate = importlib.import_module("ablate_decode")
    source = ablate.SRC.read_text()
    for name, edits in ablate.VARIANTS.items():
        for old, _ in edits:
            assert old in source, f"{name}: the kernel no longer contains {old.strip()!r}"
        module = ablate.build(name, edits, tmp_path)
        assert hasattr(module, "_lowrank_attn_fwd"), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU without CUDA says")
def test_gpu_benchmarks_say_so_on_a_cpu():
    """They failed deep inside torch ('Torch not compiled with CUDA enabled'); bench_decode_1b had no
    parser (``--help`` ran it), and bench_generate's CPU smoke test defaulted to 32k tokens on a model of
    4096 positions (the machine ran out of memory)."""
    import subprocess

    def run(*args):
        return subprocess.run([sys.executable, str(BENCHMARKS / args[0]), *args[1:]], capture_output=True,
                              text=True, timeout=120)

    for script in ("bench_attention.py", "bench_decode_1b.py", "bench_streamkl.py", "bench_generate.py"):
        out = run(script)
        assert out.returncode == 1 and "times CUDA kernels and this machine has no CUDA device" in out.stderr
        assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert run("bench_decode_1b.py", "--help").returncode == 0
    out = run("bench_generate.py", "--tiny", "--context", "5000")
    assert out.returncode == 2 and "run past the model's 4096 positions" in out.stderr
