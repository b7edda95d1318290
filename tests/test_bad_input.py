"""Bad input and faults: one clear line, the right exit status, and nothing lost (issue 12 §7).

CLI cases run through click's CliRunner on tiny random models — saved to a temporary folder, or handed
to the CLI by a monkeypatched loader — so that every test is fast and offline.
"""

import json
import logging
import os
import re
import stat
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import stiefkv
from stiefkv.calibrate.state import CalibrationState
from stiefkv.cli import main
from stiefkv.data import DataError, load_texts
from stiefkv.models import ModelLoadError
from stiefkv.projections import PROJECTIONS_FILE, CheckpointError, Projections, header_sha256, tensors_sha256
from tests.tiny import random_projections, tiny_model, tiny_tokenizer
from tests.utils import CharTokenizer, save_tiny_gguf, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's lines (stderr) are not messages
CALIBRATE_SMALL = ["--method", "pca", "--allocation", "uniform", "--num-sequences", "2", "--seq-len", "17"]


def run(args, exit_code):
    """Invoke the CLI; check the exit status and that a failure is one line without a traceback."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == exit_code, (result.output, result.exception)
    if exit_code:
        assert "Traceback" not in result.output and not isinstance(result.exception, Exception)
        lines = [line for line in result.output.splitlines()
                 if line.strip() and not line.startswith(("INFO", "WARNING"))
                 and not PROGRESS_BAR.search(line)]
        assert len(lines) == 1, result.output
    return result


@pytest.fixture
def fake_loader(monkeypatch):
    """``stiefkv.load_model`` returning a tiny model (``.model`` may be replaced) and recording its calls."""

    class Loader:
        model = None
        calls = []

        def __call__(self, spec, **kwargs):
            self.calls.append((spec, kwargs))
            return (self.model if self.model is not None else tiny_model()), CharTokenizer()

    loader = Loader()
    monkeypatch.setattr(stiefkv, "load_model", loader)
    return loader


@pytest.fixture
def model_dir(tmp_path):
    return save_tiny_model(tmp_path / "model")


# ------------------------------------------------------------------- 1. outputs that would destroy inputs


def test_output_that_is_the_data_file_is_refused(tmp_path, corpus, fake_loader):
    before = corpus.read_bytes()
    result = run(["calibrate", "m", "--data", corpus, "-o", corpus, *CALIBRATE_SMALL], 2)
    assert "which this command reads" in result.output and corpus.read_bytes() == before
    link = tmp_path / "link.safetensors"
    link.symlink_to(corpus)
    run(["calibrate", "m", "--data", corpus, "-o", link, *CALIBRATE_SMALL], 2)
    hard = tmp_path / "hard.safetensors"
    os.link(corpus, hard)
    run(["calibrate", "m", "--data", corpus, "-o", hard, *CALIBRATE_SMALL], 2)
    assert corpus.read_bytes() == before and not fake_loader.calls


def test_output_inside_the_model_folder_is_refused(model_dir, corpus):
    weights = model_dir / "model.safetensors"
    before = weights.read_bytes()
    result = run(["calibrate", model_dir, "--data", corpus, "-o", weights, *CALIBRATE_SMALL], 2)
    assert "model" in result.output and weights.read_bytes() == before
    run(["calibrate", model_dir, "--data", corpus, "-o", model_dir / "new.safetensors", *CALIBRATE_SMALL], 2)
    assert not (model_dir / "new.safetensors").exists()


def test_eval_json_over_the_checkpoint_is_refused(tmp_path, fake_loader):
    ckpt = random_projections(tiny_model(), 8, 8).save(tmp_path / "p.safetensors")
    before = ckpt.read_bytes()
    result = run(["eval", "m", "--projections", ckpt, "--json", ckpt], 2)
    assert "--json" in result.output and ckpt.read_bytes() == before and not fake_loader.calls


def test_eval_json_over_a_wikitext_file_is_refused(tmp_path, fake_loader, monkeypatch):
    data = tmp_path / "data"
    (data / "wikitext-2").mkdir(parents=True)
    test_file = data / "wikitext-2" / "wiki.test.raw"
    test_file.write_text("some text\n" * 50)
    monkeypatch.setenv("STIEFKV_DATA_DIR", str(data))
    result = run(["eval", "m", "--json", test_file], 2)
    assert "a WikiText-2 file" in result.output and test_file.read_text() == "some text\n" * 50
    assert not fake_loader.calls


def test_settings_refused_before_any_work(tmp_path, corpus, fake_loader):
    out = tmp_path / "o.safetensors"
    result = run(["calibrate", "m", "--data", corpus, "-o", out, "--plot", tmp_path / "p.png",
                  *CALIBRATE_SMALL], 2)
    assert "--allocation dp" in result.output
    for option, value in (("--lr", "inf"), ("--kl-weight", "nan")):
        result = run(["calibrate", "m", "--data", corpus, "-o", out, option, value, *CALIBRATE_SMALL], 2)
        assert "finite" in result.output
    result = run(["eval", "m", "--backend", "triton", "--device", "cpu"], 2)
    assert "--backend reference" in result.output
    # the data and every device of a list are checked before the model loads too
    (tmp_path / "empty").mkdir()
    (tmp_path / "table.csv").write_text("a,b\n")
    for data, message in [(tmp_path / "typo.txt", "is not 'wikitext2', 'self', nor an existing"),
                          (tmp_path / "empty", "holds no .txt or .jsonl files"),
                          (tmp_path / "table.csv", "data files must be .txt or .jsonl")]:
        assert message in run(["calibrate", "m", "--data", data, "-o", out, *CALIBRATE_SMALL], 2).output
        assert message in run(["eval", "m", "--data", data], 2).output
    result = run(["calibrate", "m", "--data", corpus, "--device", "cpu,cpux", "-o", out, *CALIBRATE_SMALL], 2)
    assert "--device cpux: unknown device" in result.output
    assert not fake_loader.calls and not out.exists()


def test_data_errors_name_the_file(tmp_path):
    binary = tmp_path / "latin.txt"
    binary.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="latin.txt: not UTF-8 text"):
        load_texts(str(binary))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "fine"}\n{"text": 5}\n')
    with pytest.raises(DataError, match="rows.jsonl:2: 'text' must be a string"):
        load_texts(str(rows))


def test_a_folder_a_served_model_saved_is_calibrated_and_evaluated_as_the_original(tmp_path, corpus):
    """``eval`` of the folder scores its bases against the original model (not the compressed model as
    'uncompressed'); ``calibrate`` fits bases to the original model's outputs."""
    model = tiny_model()
    folder = save_tiny_model(tmp_path / "served", model)
    stiefkv.load(model, random_projections(model, 8, 8))
    model.save_pretrained(folder)  # the bases beside the weights, named by its config.json
    stiefkv.unload(model)
    result = run(["eval", folder, "--data", corpus, "--window", 64, "--windows", 2, "--json", "-"], 0)
    doc = json.loads(result.output[result.output.index("{"):])
    assert doc["method"] == "random" and doc["ppl"] != doc["ppl_original"]
    out = tmp_path / "c.safetensors"
    run(["calibrate", folder, "--data", corpus, "-o", out, *CALIBRATE_SMALL], 0)
    plain = tmp_path / "plain.safetensors"
    run(["calibrate", save_tiny_model(tmp_path / "plain", model), "--data", corpus, "-o", plain,
         *CALIBRATE_SMALL], 0)
    for a, b in zip(Projections.load(out).keys, Projections.load(plain).keys):
        assert torch.equal(a, b)


def test_two_outputs_on_one_path_are_refused(tmp_path, corpus, fake_loader):
    out = tmp_path / "o.safetensors"
    result = run(["calibrate", "m", "--data", corpus, "-o", out, "--plot", out, *CALIBRATE_SMALL,
                  "--allocation", "dp"], 2)
    assert "same file" in result.output


# ------------------------------------------------------------------------------ 2. full-rank PCA bases


@pytest.mark.parametrize("settings", [{"method": "pca"}, {"method": "stiefel", "steps": 0}])
def test_full_rank_bases_save_and_resume(tmp_path, corpus, monkeypatch, settings):
    kw = dict(budget=1.0, allocation="uniform", data=str(corpus), num_sequences=2, seq_len=17, **settings)
    whole = stiefkv.calibrate(tiny_model(layers=3), CharTokenizer(), progress=tmp_path / "a.partial", **kw)
    assert whole.ranks == [(24, 24)] * 3
    back = Projections.load(whole.save(tmp_path / "a.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(whole.keys + whole.values, back.keys + back.values))

    save = CalibrationState.save

    def interrupted(self, path):
        save(self, path)
        if len(self.keys) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(CalibrationState, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stiefkv.calibrate(tiny_model(layers=3), CharTokenizer(), progress=tmp_path / "b.partial", **kw)
    monkeypatch.setattr(CalibrationState, "save", save)
    resumed = stiefkv.calibrate(tiny_model(layers=3), CharTokenizer(), progress=tmp_path / "b.partial",
                                resume=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(whole.keys + whole.values, resumed.keys + resumed.values))


def test_cli_full_budget_pca_writes_a_checkpoint(tmp_path, model_dir, corpus):
    out = tmp_path / "b1.safetensors"
    run(["calibrate", model_dir, "--data", corpus, "--budget", "1.0", "-o", out, *CALIBRATE_SMALL], 0)
    assert Projections.load(out).ranks == [(24, 24)] * 2
    assert not (tmp_path / "b1.safetensors.partial").exists()


# --------------------------------------------------------------------------------- 3. checkpoint contents


def write_checkpoint(path: Path, proj: Projections, *, keys=None, values=None, edit=None,
                     checksum=True) -> Path:
    """A checkpoint written around Projections.save's checks (a damaged or hand-edited file)."""
    from safetensors.torch import save_file

    keys = proj.keys if keys is None else keys
    values = proj.values if values is None else values
    header = proj.header()
    header["tensors_sha256"] = tensors_sha256(keys, values)
    if not checksum:  # a file from before the checksums
        header.pop("tensors_sha256")
        header.pop("header_sha256")
    if edit is not None:
        edit(header)
    if checksum:  # the edit as a writer would have hashed it: what is checked is the edit itself
        header["header_sha256"] = header_sha256(header)
    tensors = {f"layers.{i}.{x}": t.contiguous() for i, (k, v) in enumerate(zip(keys, values))
               for x, t in (("k", k), ("v", v))}
    save_file(tensors, str(path), metadata={"stiefkv": json.dumps(header)})
    return path


@pytest.fixture
def proj():
    return random_projections(tiny_model(), 8, 16)


def nan_keys(proj):
    keys = [k.clone() for k in proj.keys]
    keys[1][0, 3, 2] = float("nan")
    return keys


@pytest.mark.parametrize("case, message", [
    (lambda p: {"keys": nan_keys(p)}, "layer 1 key basis holds NaN"),
    (lambda p: {"keys": [k * 10 for k in p.keys]}, r"not orthonormal: max \|PᵀP − I\| = 99 > 0.001"),
    (lambda p: {"values": [v[..., :0] for v in p.values],
                "edit": lambda h: h.update(ranks=[[8, 0], [8, 0]])}, "rank 0"),
    (lambda p: {"edit": lambda h: h.update(budget="0.5")}, "budget '0.5' is not a number"),
    (lambda p: {"edit": lambda h: h.pop("ranks")}, "no 'ranks'"),
    (lambda p: {"edit": lambda h: h.update(ranks=h["ranks"][:1])}, "L=2"),
    (lambda p: {"keys": p.keys[:1], "values": p.values[:1],
                "edit": lambda h: h.update(ranks=h["ranks"][:1])}, "L=2"),
    (lambda p: {"edit": lambda h: h.update(errors="none")}, "errors is a str"),
    (lambda p: {"edit": lambda h: h.update(format_version="2")}, "format_version"),
    (lambda p: {"edit": lambda h: h.update(key_mode="sideways")}, "key_mode 'sideways'"),
    (lambda p: {"edit": lambda h: h.update(layer_key_modes=["post_rope"])}, "layer_key_modes is not a list"),
    (lambda p: {"edit": lambda h: h.update(layer_key_modes=["post_rope", "sideways"])}, "for each layer"),
    (lambda p: {"edit": lambda h: h.update(layer_key_modes=["post_rope", "pre_rope"])},
     "per-layer key modes in a format version 2 file"),
    (lambda p: {"edit": lambda h: h["fingerprint"].update(d=12)}, "exceeds the head dimension"),
    (lambda p: {"edit": lambda h: h.update(tensors_sha256="0" * 64)}, "does not match the sha256"),
    (lambda p: {"checksum": False}, "format version 2 always has one"),
    (lambda p: {"keys": [torch.tensor(1.0), p.keys[1]]}, r"tensor layers.0.k has shape \[\], not a basis"),
])
def test_damaged_checkpoint_is_refused_and_inspect_says_why(tmp_path, proj, case, message):
    path = write_checkpoint(tmp_path / "bad.safetensors", proj, **case(proj))
    with pytest.raises(CheckpointError, match=message):
        Projections.load(path)
    result = run(["inspect", path], 2)
    assert str(path) in result.output


def test_flipped_byte_in_the_tensor_data_is_caught(tmp_path, proj):
    path = proj.save(tmp_path / "p.safetensors")
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[start + 101] ^= 0x01  # one bit of one float: still finite and nearly orthonormal
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match the sha256"):
        Projections.load(path)


def test_version_1_checkpoint_loads_with_a_warning(tmp_path, proj, caplog):
    path = write_checkpoint(tmp_path / "v1.safetensors", proj, checksum=False,
                            edit=lambda h: h.update(format_version=1))
    with caplog.at_level(logging.WARNING, logger="stiefkv"):
        back = Projections.load(path)
    assert back.ranks == proj.ranks and "without a checksum" in caplog.text
    shown = run(["inspect", path], 0).output
    assert shown.count("| 8 × bf16 | 16 × bf16 |") == 2
    assert shown.strip() == back.summary().strip()  # the table from Python too
    assert repr(back).startswith("Projections(") and "tensor" not in repr(back) and len(repr(back)) < 200


def test_save_refuses_bases_that_are_not_finite_or_not_orthonormal(tmp_path, proj):
    for keys, message in ((nan_keys(proj), "NaN"), ([k * 2 for k in proj.keys], "not orthonormal")):
        bad = Projections(keys=keys, values=proj.values, key_mode=proj.key_mode, fingerprint=proj.fingerprint,
                          budget=proj.budget)
        with pytest.raises(CheckpointError, match=message):
            bad.save(tmp_path / "p.safetensors")
        with pytest.raises(CheckpointError, match=message):
            stiefkv.load(tiny_model(), bad)
    assert list(tmp_path.iterdir()) == []


def test_load_names_what_it_takes_when_given_no_checkpoint():
    for bad in (None, 3, {"keys": []}):
        with pytest.raises(TypeError, match=f"checkpoint path or Projections, got {type(bad).__name__}"):
            stiefkv.load(tiny_model(), bad)


# ------------------------------------------------------------------------------- 4. NaN in the model


@pytest.mark.parametrize("where, message", [
    ("layer", "layer 1 of the model produced NaN/inf"),
    ("embedding", "the token embeddings of the model produced NaN/inf"),
])
def test_non_finite_model_is_named_not_calibrated(corpus, where, message):
    model = tiny_model()
    with torch.no_grad():
        layer_weight, embedding = model.model.layers[1].mlp.up_proj.weight, model.model.embed_tokens.weight
        (layer_weight if where == "layer" else embedding)[:] = float("nan")
    with pytest.raises(ValueError, match=message):
        stiefkv.calibrate(model, CharTokenizer(), budget=0.5, method="pca", allocation="uniform",
                          data=str(corpus), num_sequences=2, seq_len=17)


def test_float16_overflow_suggests_float32(corpus):
    model = tiny_model().half()
    with torch.no_grad():
        mlp = model.model.layers[0].mlp
        for w in (mlp.gate_proj.weight, mlp.up_proj.weight,
                  model.model.layers[0].post_attention_layernorm.weight):
            w.fill_(10.0)
        mlp.down_proj.weight.fill_(6e4)
    with pytest.raises(ValueError, match="layer 0 .* overflows in float16 — try --dtype float32"):
        stiefkv.calibrate(model, CharTokenizer(), budget=0.5, method="pca", allocation="uniform",
                          data=str(corpus), num_sequences=2, seq_len=17)


def test_cli_non_finite_model_exits_2_and_writes_nothing(tmp_path, corpus, fake_loader):
    fake_loader.model = tiny_model()
    with torch.no_grad():
        fake_loader.model.model.layers[0].self_attn.k_proj.weight[0, 0] = float("inf")
    out = tmp_path / "o.safetensors"
    result = run(["calibrate", "m", "--data", corpus, "-o", out, *CALIBRATE_SMALL], 2)
    assert "layer 0 of the model produced NaN/inf" in result.output and not out.exists()


# --------------------------------------------------------------------------- 5. output locations, early


def test_missing_output_folders_are_made_only_when_written(tmp_path, corpus, fake_loader, monkeypatch):
    def fail(*args, **kwargs):
        raise ModelLoadError("stop here")

    # a failure after the check leaves nothing behind, not even the folders
    monkeypatch.setattr(stiefkv, "load_model", fail)
    out = tmp_path / "new" / "deeper" / "o.safetensors"
    run(["calibrate", "m", "--data", corpus, "-o", out, *CALIBRATE_SMALL], 2)
    run(["eval", "m", "--json", tmp_path / "json" / "r.json"], 2)
    assert not (tmp_path / "new").exists() and not (tmp_path / "json").exists()
    # and a run that succeeds makes them
    monkeypatch.setattr(stiefkv, "load_model", fake_loader)
    run(["calibrate", "m", "--data", corpus, "-o", out, *CALIBRATE_SMALL], 0)
    assert out.is_file()
    report = tmp_path / "json" / "deeper" / "r.json"
    run(["eval", "m", "--data", corpus, "--windows", "1", "--window", "32", "--json", report], 0)
    assert json.loads(report.read_text())["windows"] == 1


def test_outputs_behind_a_file_or_a_dangling_link_fail_before_loading(tmp_path, corpus, fake_loader):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "gone").symlink_to(tmp_path / "missing")
    for out in (tmp_path / "a-file" / "new" / "o.safetensors", tmp_path / "gone" / "new" / "o.safetensors"):
        result = run(["calibrate", "m", "--data", corpus, "-o", out, *CALIBRATE_SMALL], 2)
        assert "cannot write -o" in result.output
    assert not fake_loader.calls and not (tmp_path / "missing").exists()


def test_unwritable_outputs_fail_before_loading(tmp_path, corpus, fake_loader):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = run(["calibrate", "m", "--data", corpus, "-o", blocker / "o.safetensors", *CALIBRATE_SMALL], 2)
    assert "cannot write -o" in result.output
    result = run(["eval", "m", "--json", blocker / "r.json"], 2)
    assert "cannot write --json" in result.output
    result = run(["calibrate", "m", "--data", corpus, "-o", tmp_path, *CALIBRATE_SMALL], 2)
    assert "is a folder" in result.output
    assert not fake_loader.calls


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_fails_before_loading(tmp_path, corpus, fake_loader):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    result = run(["calibrate", "m", "--data", corpus, "-o", folder / "o.safetensors", *CALIBRATE_SMALL], 2)
    assert "cannot write -o" in result.output and not fake_loader.calls


def test_api_progress_location_is_checked_first(tmp_path, corpus):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="cannot write progress file"):
        stiefkv.calibrate(tiny_model(), CharTokenizer(), data=str(corpus),
                          progress=tmp_path / "f" / "p.partial")


# ----------------------------------------------------------------------------- 7. context length


def test_context_beyond_the_models_positions_is_refused(tmp_path, corpus, fake_loader):
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        stiefkv.calibrate(tiny_model(), CharTokenizer(), data=str(corpus), seq_len=513)
    result = run(["calibrate", "m", "--data", corpus, "-o", tmp_path / "o", "--seq-len", "1024"], 2)
    assert "--seq-len 1024 exceeds the model's 512 positions" in result.output
    result = run(["eval", "m", "--window", "600"], 2)
    assert "--window 600 exceeds the model's 512 positions" in result.output
    ckpt = random_projections(tiny_model(), 8, 8).save(tmp_path / "p.safetensors")
    result = run(["eval", "m", "--projections", ckpt, "--window", "64", "--attention-kl", "--kl-context",
                  "8192"], 2)
    assert "--kl-context 8192 exceeds the model's 512 positions" in result.output


def test_a_compacted_context_names_the_largest_that_fits_and_the_option_to_lower(tmp_path, fake_loader):
    """``--compact`` scores 512 tokens after the context (32 for a pass key): the largest ``--context`` the
    positions allow is named, and test text too short for one chunk asks for a shorter --context."""
    result = run(["eval", "m", "--compact", "0.1", "--context", "512", "--windows", "1"], 2)
    assert "512 scored tokens need 1024 positions" in result.output
    assert "the scored tokens alone leave no room for a context" in result.output  # was "at most 0"
    result = run(["eval", "m", "--compact", "0.1", "--context", "500", "--passkey", "1"], 2)
    assert "use --context (context=) at most 480" in result.output
    result = run(["eval", "m", "--compact", "0.1", "--context", "100", "--passkey", "0"], 2)
    assert "--passkey N is the number of pass-key prompts: N ≥ 1, got 0" in result.output
    result = run(["eval", "m", "--compact", "0.1", "--context", "20", "--passkey", "1"], 2)
    assert re.search(r"a pass-key prompt needs at least \d+ tokens of context .* got 20: raise --context",
                     result.output), result.output
    short = tmp_path / "short.txt"
    short.write_text("a few words of test text, fewer than one chunk of context and scored tokens. " * 3)
    with pytest.raises(ValueError, match="fewer than 300 tokens: a chunk is a context of 200 and 100 scored "
                                         "tokens; lower --context"):
        from stiefkv.longcontext import evaluate_compacted

        evaluate_compacted(tiny_model(), CharTokenizer(), context=200, score=100, data=str(short))
    ckpt = random_projections(tiny_model(), 8, 8).save(tmp_path / "p.safetensors")
    result = run(["eval", "m", "--compact", "0.1", "--projections", ckpt, "--compact-method", "snapkv"], 2)
    assert "use --compact-method am or attention (not snapkv), or drop --projections" in result.output
    assert "--passkey" not in result.output


def test_kl_context_beyond_the_test_text_is_refused_before_the_evaluation(tmp_path, fake_loader, monkeypatch):
    """``--attention-kl`` with more ``--kl-context`` tokens than the test text holds is refused before the
    perplexity pass (which ran first and was lost)."""
    import stiefkv.evaluate

    short = tmp_path / "short.txt"
    short.write_text("a few words of test text, far fewer than the context asked for. " * 3)
    monkeypatch.setattr(stiefkv.evaluate, "evaluate", lambda *a, **k: pytest.fail("evaluated first"))
    ckpt = random_projections(tiny_model(), 8, 8).save(tmp_path / "p.safetensors")
    result = run(["eval", "m", "--projections", ckpt, "--window", "64", "--data", short, "--attention-kl",
                  "--kl-context", "500"], 2)
    assert "fewer than --kl-context 500" in result.output and "lower --kl-context" in result.output


# ------------------------------------------------------------------------ 8. no tracebacks on bad values


def test_a_tokenizer_beyond_the_models_vocabulary_is_named_before_the_work(tmp_path, corpus, fake_loader):
    """Found by a tester: a tokenizer whose ids exceed the model's vocabulary failed with an IndexError from
    the embedding in the first forward of calibrate and eval."""
    model = tiny_model()
    model.resize_token_embeddings(40)  # CharTokenizer's ids reach 92
    model.config.max_position_embeddings = 1024  # room for --compact's 512 scored tokens
    fake_loader.model = model
    said = r"the tokenizer's ids of data '.*calib.txt' hold ids outside the model's vocabulary \[0, 40\): .*"
    for args in (["calibrate", "m", "--data", corpus, "-o", tmp_path / "o.safetensors", *CALIBRATE_SMALL],
                 ["eval", "m", "--data", corpus, "--window", 32, "--windows", 1],
                 ["eval", "m", "--data", corpus, "--compact", 0.5, "--context", 40, "--windows", 1]):
        result = run(args, 2)
        assert re.search(said + "give the model's own tokenizer", result.output), result.output
    result = run(["eval", "m", "--compact", 0.5, "--context", 400, "--passkey", 2], 2)  # prompts made here
    assert "ids of data 'the pass-key prompts' hold ids outside the model's vocabulary" in result.output
    with pytest.raises(DataError, match=said):
        stiefkv.calibrate(model, CharTokenizer(), data=str(corpus), num_sequences=2, seq_len=17, method="pca",
                          allocation="uniform")
    from stiefkv.evaluate import attention_kl_per_layer

    with pytest.raises(DataError, match=said):
        attention_kl_per_layer(model, CharTokenizer(), random_projections(model, 8, 8), data=str(corpus),
                               context=32, stream=torch.arange(50, 150))


@pytest.mark.parametrize("args, message", [
    (["eval", "m", "--window", "0"], "--window must be ≥ 2, got 0"),
    (["eval", "m", "--window", "-1"], "--window must be ≥ 2, got -1"),
    (["eval", "m", "--window", "1"], "--window must be ≥ 2, got 1"),
    (["eval", "m", "--kl-context", "0"], "--kl-context must be ≥ 2, got 0"),
    (["eval", "m", "--batch-size", "0"], "--batch-size must be ≥ 1"),
    (["eval", "m", "--device", "foo"], "--device foo: unknown device 'foo'"),
    (["calibrate", "m", "--device", "foo", "-o", "x.safetensors"], "unknown device 'foo'"),
    # the calibration settings' checks, named as the options typed (not num_sequences, budget, ...)
    (["calibrate", "m", "--budget", "2", "-o", "x.safetensors"], "--budget must be in (0, 1], got 2.0"),
    (["calibrate", "m", "--num-sequences", "0", "-o", "x.safetensors"], "--num-sequences must be ≥ 1, got 0"),
    (["calibrate", "m", "--seq-len", "1", "-o", "x.safetensors"], "--seq-len must be ≥ 2, got 1"),
    (["calibrate", "m", "--rank-step", "0", "-o", "x.safetensors"], "--rank-step must be ≥ 1, got 0"),
])
def test_bad_values_are_one_line(args, message, fake_loader):
    assert message in run(args, 2).output and not fake_loader.calls


def test_option_names_are_not_written_into_paths(tmp_path):
    """A setting named in a message becomes its option only as a word of its own: a path ending in
    ``/data`` stayed ``/--data``."""
    folder = tmp_path / "data"
    folder.mkdir()
    out = run(["eval", str(folder)], 2).output
    assert f"{folder} " in out and "/--data" not in out


def test_rank_step_larger_than_the_head_dim(tmp_path, corpus, fake_loader):
    for allocation in ("dp", "uniform"):
        result = run(["calibrate", "m", "--data", corpus, "--rank-step", "48", "--allocation", allocation,
                      "-o", tmp_path / "o.safetensors"], 2)
        assert "--rank-step 48 must divide the model's head dimension d=24" in result.output


def test_a_typo_of_an_alias_is_named_at_once(monkeypatch):
    """Not looked up on the hub (half a minute of retries offline): the alias it misses is named."""
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("looked up on the hub")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    for typo in ("smollm3", "SmolLM2", "smolm2"):
        with pytest.raises(ModelLoadError, match=f"model '{typo}' is neither an alias nor a local path: "
                                                 "did you mean 'smollm2'"):
            stiefkv.load_model(typo)
        # stiefkv eval looked for a hub id's bases first: 25 s of retries offline before the same message
        result = run(["eval", typo, "--windows", "1"], 2)
        assert "did you mean 'smollm2'" in result.output and "looked up on the hub" not in result.output
    with pytest.raises(AssertionError, match="looked up on the hub"):
        stiefkv.load_model("gpt2")  # far from every alias: a hub id


def test_calibrate_calls_it_cannot_take_are_named(tmp_path, corpus):
    """The Python API: a served model (its layers already compressed), no model, text without a tokenizer,
    a device setting, and sequences that are not token ids of the model."""
    model = tiny_model()
    tok = CharTokenizer()
    kw = dict(data=str(corpus), num_sequences=4, seq_len=32, steps=1, method="pca", allocation="uniform")
    served = stiefkv.load(tiny_model(), random_projections(model, 8, 8))
    with pytest.raises(ValueError, match="served by stiefkv.load: calibrating it would fit its compressed"):
        stiefkv.calibrate(served, tok, **kw)
    with pytest.raises(TypeError, match="calibrate takes a loaded causal LM .* got str"):
        stiefkv.calibrate("smollm2", tok, **kw)
    with pytest.raises(ValueError, match="needs the model.s tokenizer to read or sample its calibration"):
        stiefkv.calibrate(model, None, **kw)
    with pytest.raises(TypeError, match="calibrate has no device setting"):
        stiefkv.calibrate(model, tok, device="cpu", **kw)
    seqs = torch.randint(3, 97, (4, 32))
    for bad, message in ((seqs.float(), "integer token ids"), (seqs + 1000, "outside the model's vocabulary"),
                         (seqs.tolist(), r"\[batch, tokens\] tensor"), (seqs[:, :1], "2 tokens")):
        with pytest.raises(ValueError, match=message):
            stiefkv.calibrate(model, None, sequences=bad, budget=0.5, method="pca", allocation="uniform")
    with pytest.raises(ValueError, match="profile 'stiefel' needs weighting 'output' or 'update'"):
        stiefkv.calibrate(model, tok, profile="stiefel", **kw)
    with pytest.raises(ValueError, match="this torch or machine has no MPS device"):
        stiefkv.models.resolve_device("mps")
    for name in ("", ".", "not-yet-made/", "/"):  # Path("not-yet-made/") would write the file not-yet-made
        result = run(["calibrate", "m", "--data", corpus, "-o", name], 2)
        assert "names a folder, not the file to write" in result.output
    for args in (["calibrate", "m", "-o", "m.safetensors", "--plot", "plots/"],
                 ["eval", "m", "--json", "out/"]):
        assert "names a folder, not the file to write" in run(args, 2).output


def test_calibrate_refuses_data_settings_that_contradict_sequences(corpus):
    """``sequences=`` are the calibration text and their shape its size: a ``data=``, ``num_sequences=`` or
    ``seq_len=`` beside them used to be ignored without a word. Values the sequences agree with still pass."""
    model = tiny_model()
    seqs = torch.randint(3, 97, (3, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(budget=0.5, method="pca", allocation="uniform")
    shape = r"contradicts sequences= of shape \[3, 12\], whose shape sets it"
    for given, message in (({"data": str(corpus)}, r"^data=.* and sequences= both name the calibration"),
                           ({"num_sequences": 5}, rf"^num_sequences=5 {shape}"),
                           ({"seq_len": 64}, rf"^seq_len=64 {shape}")):
        with pytest.raises(ValueError, match=message):
            stiefkv.calibrate(model, CharTokenizer(), sequences=seqs, **kw, **given)
    proj = stiefkv.calibrate(model, None, sequences=seqs, num_sequences=3, seq_len=12, **kw)
    assert proj.settings["tokens"] == 3 * 12


def tiny_llava():
    """A Llava model around a tiny Llama: its language model's layers are not at ``.model.layers``."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from tests.tiny import tiny_config

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                              num_attention_heads=2, image_size=16, patch_size=8)
    config = LlavaConfig(text_config=tiny_config("llama"), vision_config=vision, image_token_index=5)
    return LlavaForConditionalGeneration(config).eval()


def test_calibrating_an_unsupported_model_names_its_architecture(corpus):
    """Found by a tester: stiefkv.calibrate of a GPT-2 or a Llava model said "… has no decoder layers at
    .model.layers" (the served-model check looked for the layers before the architecture was checked)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    kw = dict(data=str(corpus), num_sequences=2, seq_len=16, method="pca", allocation="uniform")
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=97)).eval()
    with pytest.raises(ModelLoadError, match=r"^unsupported architecture 'gpt2'; StiefKV supports Llama"):
        stiefkv.calibrate(gpt2, CharTokenizer(), **kw)
    with pytest.raises(ModelLoadError, match=r"^unsupported architecture 'llava' \(a llama language model "
                                             r"inside another\); StiefKV supports Llama-style"):
        stiefkv.calibrate(tiny_llava(), CharTokenizer(), **kw)


def test_settings_without_effect_are_named(corpus, caplog):
    from stiefkv.calibrate.pipeline import CalibrationConfig, unused_settings

    given = dict(method="pca", allocation="uniform", steps=5, kl_weight=0.5, weighting="output")
    with caplog.at_level(logging.WARNING):
        stiefkv.calibrate(tiny_model(), CharTokenizer(), data=str(corpus), num_sequences=4, seq_len=32,
                          budget=0.5, **given)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for note in ("steps has no effect with method 'pca'", "kl_weight has no effect with method 'pca'",
                 "weighting has no effect with allocation 'uniform'"):
        assert any(note in line for line in said), said
    assert not any("budget" in line and "no effect" in line for line in said)
    stiefel = dict(kl_weight=0.5, recent=4096, bits="4")
    notes = unused_settings(stiefel, CalibrationConfig.from_kwargs(**stiefel))
    assert notes == ["kl_weight has no effect without loss 'output+kl' (--loss output+kl)",
                     "recent 4096 keeps every token of the 2048-token cache the budget is counted at exact: "
                     "the codes are never read there"]
    assert unused_settings({"kl_weight": 0.5, "loss": "output+kl"},
                           CalibrationConfig.from_kwargs(kl_weight=0.5, loss="output+kl")) == []


def test_the_cli_warns_only_of_options_given(tmp_path, corpus, monkeypatch, caplog):
    """The CLI passed every option's default on, so each was "given": any stiefel run warned of kl_weight,
    and README's PCA command of five settings. Only options typed are passed now."""
    monkeypatch.setattr(stiefkv, "load_model", lambda spec, **kw: (tiny_model(), CharTokenizer()))
    base = ["calibrate", "tiny", "--data", corpus, "--num-sequences", "4", "--seq-len", "32",
            "--method", "pca", "--allocation", "uniform"]
    for extra, name in (([], "a"), (["--steps", "5"], "b")):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            run([*base, *extra, "-o", tmp_path / f"{name}.safetensors"], 0)
        said = " ".join(r.getMessage() for r in caplog.records if "no effect" in r.getMessage())
        assert said == ("--steps has no effect with method 'pca' (no refinement)" if extra else ""), said


def test_model_folder_without_weights_and_a_broken_gguf(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("STIEFKV_CACHE_DIR", str(tmp_path / "cache"))
    (model_dir / "model.safetensors").unlink()
    result = run(["calibrate", model_dir, "-o", tmp_path / "o.safetensors"], 2)
    assert "holds a config.json but no weights" in result.output
    version_3_header_only = b"GGUF" + struct.pack("<I", 3) + bytes(92)
    for name, content in (("short.gguf", os.urandom(100)), ("v3.gguf", version_3_header_only)):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelLoadError, match=name):
            stiefkv.models._load_gguf(tmp_path / name)
        result = run(["calibrate", tmp_path / name, "-o", tmp_path / "o.safetensors"], 2)
        assert name in result.output


def test_damaged_or_mismatched_weights_are_one_line(tmp_path, model_dir):
    """Found by a tester: a truncated model.safetensors escaped as safetensors' own error, and a config whose
    num_key_value_heads does not match the weights as transformers' RuntimeError pointing at a report the
    CLI does not show."""
    weights = model_dir / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    damaged = r"^cannot load the weights of model .*\(SafetensorError: .*\): a weights file is damaged"
    with pytest.raises(ModelLoadError, match=damaged):
        stiefkv.load_model(str(model_dir))
    result = run(["calibrate", model_dir, "-o", tmp_path / "o.safetensors"], 2)
    assert "a weights file is damaged or incomplete" in result.output
    weights.write_bytes(whole)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"num_key_value_heads": 3}))
    mismatch = (r"^cannot load the weights of model .*: model.layers.0.self_attn.k_proj.weight is \[48, 48\] "
                r"in model.safetensors but \[72, 48\] by its config.json; use the config.json saved with "
                "these weights")
    with pytest.raises(ModelLoadError, match=mismatch):
        stiefkv.load_model(str(model_dir))
    result = run(["eval", model_dir, "--window", 32, "--windows", 1], 2)
    assert "k_proj.weight is [48, 48]" in result.output


def test_truncated_progress_file_with_resume(tmp_path, corpus, fake_loader):
    out = tmp_path / "o.safetensors"
    partial = tmp_path / "o.safetensors.partial"
    run(["calibrate", "m", "--data", corpus, "-o", out, *CALIBRATE_SMALL], 0)
    CalibrationState(settings={}, fingerprint={}, eig_k=[torch.eye(3)]).save(partial)
    partial.write_bytes(partial.read_bytes()[:-5])
    result = run(["calibrate", "m", "--data", corpus, "-o", out, "--resume", *CALIBRATE_SMALL], 2)
    assert "is damaged" in result.output and "delete it" in result.output


def test_resume_with_other_settings_says_which_and_gives_one_remedy(tmp_path, corpus, fake_loader,
                                                                   monkeypatch):
    """The progress file's settings against the new ones, without the failure hint that says to rerun with
    --resume (which is what just failed)."""
    save = CalibrationState.save

    def interrupted_save(self, path):
        save(self, path)
        raise KeyboardInterrupt

    out = tmp_path / "o.safetensors"
    monkeypatch.setattr(CalibrationState, "save", interrupted_save)
    run(["calibrate", "m", "--data", corpus, "-o", out, *CALIBRATE_SMALL], 1)
    monkeypatch.setattr(CalibrationState, "save", save)
    result = run(["calibrate", "m", "--data", corpus, "-o", out, "--resume", "--budget", "0.75",
                  *CALIBRATE_SMALL], 2)
    assert "other settings (--budget 0.5 there, 0.75 now): rerun with its settings to continue it, or " \
           "delete it to start over" in result.output
    assert "--resume" not in result.output


def test_failure_names_the_progress_file_it_kept(tmp_path, corpus, fake_loader, monkeypatch):
    import stiefkv.calibrate.pipeline as pipeline

    def fail(*args, **kwargs):
        raise torch.linalg.LinAlgError("eigh failed to converge")

    monkeypatch.setattr(pipeline, "fit_layer", fail)
    out = tmp_path / "o.safetensors"
    result = run(["calibrate", "m", "--data", corpus, "-o", out, *CALIBRATE_SMALL], 1)
    assert f"kept in {out}.partial: rerun with --resume to continue, or delete it" in result.output


# ---------------------------------------------------------------- 9. the cache and the files' mode


def test_gguf_cache_is_keyed_by_content(tmp_path, monkeypatch):
    import transformers

    from stiefkv.models import _gguf_cache_path, _remove_legacy_cache_entries

    monkeypatch.setenv("STIEFKV_CACHE_DIR", str(tmp_path / "cache"))
    for folder in ("env1", "env2"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "m.gguf").write_bytes(b"GGUF" + bytes(200))
    a, b = _gguf_cache_path(tmp_path / "env1" / "m.gguf"), _gguf_cache_path(tmp_path / "env2" / "m.gguf")
    assert a == b
    (tmp_path / "env2" / "m.gguf").write_bytes(b"GGUF" + bytes(199) + b"\x01")
    assert _gguf_cache_path(tmp_path / "env2" / "m.gguf") != a
    cache = tmp_path / "cache" / "gguf"
    # a cache written by transformers 5 is not read by transformers 4 (its tokenizer names a v5 class)
    assert a.name.endswith(f"-transformers{transformers.__version__.split('.')[0]}")
    by_path, unversioned = cache / "m-0123456789ab", cache / a.name.rsplit("-", 1)[0]
    other = cache / "n-0123456789ab"
    for folder in (by_path, unversioned, other, a):
        folder.mkdir(parents=True)
    _remove_legacy_cache_entries(tmp_path / "env1" / "m.gguf")
    assert not by_path.exists() and not unversioned.exists() and other.exists() and a.exists()


def test_a_gguf_of_another_architecture_is_refused_from_its_header_before_converting(tmp_path, monkeypatch):
    """Found by a tester: a phi3 GGUF was de-quantised and cached in full before arch_of refused it, naming
    an empty list of classes "()". A supported one still converts."""
    monkeypatch.setenv("STIEFKV_CACHE_DIR", str(tmp_path / "cache"))
    phi3 = save_tiny_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(ModelLoadError, match=r"^unsupported architecture 'phi3' \(general.architecture of "
                                             r"phi.gguf\); StiefKV supports Llama-style attention: llama, "):
        stiefkv.load_model(str(phi3))
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())
    result = run(["calibrate", phi3, "-o", tmp_path / "o.safetensors"], 2)
    assert "unsupported architecture 'phi3'" in result.output
    model, _ = stiefkv.load_model(str(save_tiny_gguf(tmp_path / "llama.gguf", "llama")))
    assert type(model).__name__ == "LlamaForCausalLM"
    from transformers import GPT2Config

    with pytest.raises(ModelLoadError, match=r"^unsupported architecture 'gpt2'; StiefKV supports"):
        stiefkv.models.arch_of(GPT2Config())  # no classes named: no empty "()"


def test_a_gguf_suffix_in_capitals_is_a_gguf(tmp_path, monkeypatch):
    """Found by a tester: model.GGUF was taken for a model folder ("holds no config.json")."""
    monkeypatch.setenv("STIEFKV_CACHE_DIR", str(tmp_path / "cache"))
    model, _ = stiefkv.load_model(str(save_tiny_gguf(tmp_path / "model.GGUF")))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert stiefkv.models.served_bases(str(tmp_path / "model.GGUF")) is None
    inside_the_cache = tmp_path / "cache" / "gguf" / "o.safetensors"
    result = run(["calibrate", tmp_path / "model.GGUF", "-o", inside_the_cache], 2)
    assert "the de-quantised model cache" in result.output


def test_a_folder_whose_tokenizer_this_transformers_cannot_read_is_named(tmp_path, monkeypatch):
    """A tokenizer class this transformers lacks (transformers 4.57 reading a folder transformers 5 wrote says
    what the stub below says) is told apart from a folder without tokenizer files."""
    import transformers

    folder = save_tiny_model(tmp_path / "m")
    errors = [ValueError("Tokenizer class TokenizersBackend does not exist or is not currently imported."),
              OSError(f"Can't load tokenizer for '{folder}'.")]

    def fail(*args, **kwargs):
        raise errors.pop(0)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    with pytest.raises(ModelLoadError, match="written by a newer transformers .this is [0-9.]+.: upgrade"):
        stiefkv.load_model(str(folder))
    with pytest.raises(ModelLoadError, match="needs tokenizer files beside the weights"):
        stiefkv.load_model(str(folder))


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_written_files_honour_the_umask(tmp_path, proj, umask_022):
    from transformers import PreTrainedTokenizerFast

    from stiefkv.models import _save_plain

    path = proj.save(tmp_path / "p.safetensors")
    CalibrationState(settings={}, fingerprint={}, eig_k=[torch.eye(3)]).save(tmp_path / "s.partial")
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert oct((tmp_path / "s.partial").stat().st_mode & 0o777) == oct(0o644)
    tok = PreTrainedTokenizerFast.from_pretrained(save_tiny_model(tmp_path / "m"))
    _save_plain(tiny_model(), tok, tmp_path / "plain")
    assert oct((tmp_path / "plain" / "model.safetensors").stat().st_mode & 0o777) == oct(0o644)


# ---------------------------------------------------------------------------------- 10. data location


def test_wikitext_is_found_beside_the_repository_or_in_the_working_directory(tmp_path, monkeypatch):
    import stiefkv.data as data

    assert data.repository_data_dir() == ROOT.parent / "shared" / "data"
    monkeypatch.delenv("STIEFKV_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    repo = tmp_path / "repo-data"
    monkeypatch.setattr(data, "repository_data_dir", lambda: repo)
    with pytest.raises(DataError) as info:
        load_texts("wikitext2", "test")
    for place in ("beside the repository checkout", str(repo), "the working directory",
                  str(tmp_path / "data" / "wikitext-2"), "datasets"):
        assert place in str(info.value)
    (tmp_path / "data" / "wikitext-2").mkdir(parents=True)
    (tmp_path / "data" / "wikitext-2" / "wiki.test.raw").write_text("CWD")
    assert load_texts("wikitext2", "test") == ["CWD"]
    (repo / "wikitext-2").mkdir(parents=True)
    (repo / "wikitext-2" / "wiki.test.raw").write_text("REPO")
    assert load_texts("wikitext2", "test") == ["REPO"]
    monkeypatch.setenv("STIEFKV_DATA_DIR", str(tmp_path / "nowhere"))
    assert load_texts("wikitext2", "test") == ["REPO"]  # a wrong variable falls through, listed on failure


# ---------------------------------------------------------------------------------- 11. --device auto


def test_device_defaults_to_auto(tmp_path, corpus, fake_loader, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run(["calibrate", "m", "-o", tmp_path / "o.safetensors", "--seq-len", "1024"], 2)  # stops after loading
    run(["eval", "m", "--window", "1024", "--data", corpus], 2)  # past the tiny model's positions
    assert [kwargs["device"] for _, kwargs in fake_loader.calls] == ["cpu", "cpu"]
    assert stiefkv.models.resolve_device("auto") == torch.device("cpu")


# ---------------------------------------------------------------------------- 12. phases and their time


def test_progress_names_the_phase_and_the_expected_time(corpus, caplog):
    with caplog.at_level(logging.INFO, logger="stiefkv"):
        stiefkv.calibrate(tiny_model(layers=3), CharTokenizer(), budget=0.5, data=str(corpus),
                          num_sequences=2, seq_len=17, steps=2, step_sequences=1, profile_sequences=1)
    assert "phase 1/2 profiles: layer 0 took" in caplog.text
    assert "phase 2/2 stiefel layers: layer 0 took" in caplog.text
    assert "expect about" in caplog.text and "for the other 2 layers" in caplog.text


def test_the_expected_time_counts_each_layers_forward(corpus, caplog, monkeypatch):
    """Every layer pays its forward and advance: a first layer timed without them promised 5 s for
    SmolLM2's other 29 layers where they took about 32."""
    import time

    from stiefkv.calibrate.collect import LayerInputs

    run = LayerInputs.run

    def slow(self, *args, **kwargs):
        time.sleep(0.3)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(LayerInputs, "run", slow)
    with caplog.at_level(logging.INFO, logger="stiefkv"):
        stiefkv.calibrate(tiny_model(layers=2), CharTokenizer(), budget=0.5, data=str(corpus), method="pca",
                          num_sequences=2, seq_len=17, profile_sequences=1)
    took = [float(t) for t in re.findall(r"layer 0 took ([0-9.]+) s", caplog.text)]
    assert len(took) == 2 and min(took) >= 0.3, caplog.text


# ------------------------------------------------------------------------ 15. a folder with projections


def test_load_model_applies_the_projections_in_its_folder(model_dir):
    from stiefkv.attention import is_compressed

    model, _ = stiefkv.load_model(str(model_dir))
    stiefkv.load(model, random_projections(model, 8, 16))
    model.save_pretrained(model_dir)
    compressed, _ = stiefkv.load_model(str(model_dir))
    assert is_compressed(compressed) and is_compressed(model)
    result = run(["eval", model_dir, "--compact", "0.5", "--passkey", "2", "--context", "120"], 2)
    assert "--passkey measures the uncompressed model only" in result.output  # it did, naming no bases
    plain, _ = stiefkv.load_model(str(model_dir), projections=False)
    assert not is_compressed(plain)
    plain.save_pretrained(model_dir)  # the bases file stays beside the weights, and is no longer named


def test_a_folder_saved_by_an_unserved_model_is_not_served_by_the_bases_left_in_it(model_dir, corpus, caplog):
    """save_pretrained leaves files it did not write: after unload (or projections=False) a folder saved over
    a served one kept the old bases, and load_model served them. Bases placed by hand are not served either;
    bases that no longer fit the weights saved there name the file and the ways out."""
    from stiefkv.attention import is_compressed

    model, _ = stiefkv.load_model(str(model_dir))
    stiefkv.load(model, random_projections(model, 8, 16))
    model.save_pretrained(model_dir)
    stiefkv.unload(model)
    model.save_pretrained(model_dir)
    assert (model_dir / PROJECTIONS_FILE).is_file()
    with pytest.warns(UserWarning, match="is not served: the folder's config.json does not name it"):
        again, _ = stiefkv.load_model(str(model_dir))
    assert not is_compressed(again)
    with caplog.at_level(logging.WARNING):  # eval scored the original alone and said nothing
        run(["eval", model_dir, "--data", corpus, "--window", 32, "--windows", 1], 0)
    assert "is not evaluated: the folder's config.json does not name it" in caplog.text
    stiefkv.load(model, random_projections(model, 8, 16))
    model.save_pretrained(model_dir)
    stiefkv.unload(model)
    with torch.no_grad():  # a fine-tune saved over the folder by plain transformers code
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    model.config.stiefkv_projections = PROJECTIONS_FILE  # as from_pretrained of the served folder has it
    model.save_pretrained(model_dir)
    with pytest.raises(CheckpointError, match=f"{PROJECTIONS_FILE}, the bases saved in this model folder, do "
                                              "not fit.*projections=False, or delete the file"):
        stiefkv.load_model(str(model_dir))


def test_a_corrupt_bases_file_in_a_model_folder_is_named_corrupt_not_unfit(model_dir):
    """Found by a tester: one flipped byte in the bases a served model saved was reported as bases that "do
    not fit the model saved there now (… the file is corrupt …)"."""
    model, _ = stiefkv.load_model(str(model_dir))
    stiefkv.load(model, random_projections(model, 8, 16))
    model.save_pretrained(model_dir)
    data = bytearray((model_dir / PROJECTIONS_FILE).read_bytes())
    data[8 + struct.unpack("<Q", data[:8])[0] + 101] ^= 0x01
    (model_dir / PROJECTIONS_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"^the bases saved in model folder .* cannot be read: .*"
                                              r"the file is corrupt .*projections=False") as info:
        stiefkv.load_model(str(model_dir))
    assert "do not fit" not in str(info.value)
    result = run(["eval", model_dir, "--window", 32, "--windows", 1], 2)
    assert "the file is corrupt" in result.output and "do not fit" not in result.output


# ------------------------------------------------------------------------ 16. writing files


def test_files_are_written_whole_or_not_at_all(tmp_path):
    """A failed write (a full disk, a size limit) overwrote --json and --plot in place, and a checkpoint's
    failure was safetensors' own error naming a temporary file (a long name's temporary name was too long)."""
    from stiefkv.projections import write_atomically

    old = tmp_path / "res.json"
    old.write_text('{"ok": 1}')

    def half_then_fail(tmp):
        tmp.write_text('{"o')
        raise OSError(27, "File too large")

    with pytest.raises(OSError, match=f"cannot write --json {old}: File too large"):
        write_atomically(old, half_then_fail, "--json")
    assert old.read_text() == '{"ok": 1}' and os.listdir(tmp_path) == ["res.json"]

    def safetensors_fails(tmp):
        from safetensors import SafetensorError
        raise SafetensorError(f"Error while serializing: I/O error at path {tmp}")

    with pytest.raises(OSError, match="cannot write checkpoint .*p.safetensors: Error while serial") as err:
        write_atomically(tmp_path / "p.safetensors", safetensors_fails, "checkpoint")
    assert ".stiefkv-" not in str(err.value)
    long = tmp_path / ("y" * 240 + ".safetensors")  # a legal name; the temporary one is short
    random_projections(tiny_model(), 8, 16).save(long)
    assert Projections.load(long).ranks
    with pytest.raises(IsADirectoryError, match="it is a folder"):
        random_projections(tiny_model(), 8, 16).save(tmp_path)


def test_a_checkpoint_load_would_refuse_is_not_written(tmp_path):
    from dataclasses import replace

    good = random_projections(tiny_model(), 8, 16)
    for bad, message in ((replace(good, budget=2.0), "budget 2.0 is not a number in"),
                         (replace(good, fingerprint={}), "fingerprint L is None"),
                         (replace(good, settings={"data": tmp_path}), "its header is not JSON")):
        with pytest.raises(ValueError, match=f"refusing to write {tmp_path / 'x.safetensors'}: {message}"):
            bad.save(tmp_path / "x.safetensors")
    assert not os.listdir(tmp_path)


def test_checkpoint_api_edges(tmp_path, monkeypatch):
    """Found by a tester (helper 60): ``~`` worked for save and not for load; a NaN error was written as bare
    NaN (not JSON); save_pretrained wrote the weights and a config.json naming the bases before the bases
    were refused, and a folder whose config names bases it does not hold loaded as the original model,
    silently; ``==`` between checkpoints raised; header() handed out the checkpoint's own dicts; a
    contradicting key mode was read differently by older readers; a nested header raised RecursionError;
    a context of 0 divided by zero."""
    import json
    from dataclasses import replace

    from safetensors.torch import save_file

    monkeypatch.setenv("HOME", str(tmp_path))
    model = tiny_model()
    proj = random_projections(model, 8, 16)
    proj.save("~/p.safetensors")
    assert Projections.load("~/p.safetensors").ranks == proj.ranks
    assert Projections.stored_header("~/p.safetensors")["ranks"] == [list(r) for r in proj.ranks]
    with pytest.raises(ValueError, match="its header is not JSON"):
        replace(proj, errors=[float("nan")]).save(tmp_path / "nan.safetensors")
    assert (proj == Projections.load(tmp_path / "p.safetensors")) is False and proj == proj
    header = proj.header()
    header["fingerprint"]["L"] = 99
    header["settings"]["x"] = 1
    assert proj.fingerprint["L"] != 99 and "x" not in proj.settings
    for context in (0, -5, 1.5):
        with pytest.raises(ValueError, match="context must be a whole number of tokens ≥ 1"):
            proj.kv_bytes_per_token(context)

    stiefkv.load(model, replace(proj, settings={"data": tmp_path}))
    with pytest.raises(ValueError, match="its header is not JSON"):
        model.save_pretrained(tmp_path / "folder")
    assert not (tmp_path / "folder").exists()
    stiefkv.load(model, proj)
    model.save_pretrained(tmp_path / "folder")
    tiny_tokenizer().save_pretrained(tmp_path / "folder")
    (tmp_path / "folder" / PROJECTIONS_FILE).unlink()
    with pytest.raises(ModelLoadError, match="names StiefKV bases .* but does not hold them"):
        stiefkv.load_model(str(tmp_path / "folder"))
    assert not stiefkv.attention.is_compressed(stiefkv.load_model(str(tmp_path / "folder"),
                                                                  projections=False)[0])

    doc = proj.header()
    doc.pop("header_sha256")
    doc["layer_key_modes"] = ["post_rope"] * len(proj.ranks)  # beside key_mode pre_rope, version 2
    doc["header_sha256"] = header_sha256(doc)
    tensors = {f"layers.{i}.{x}": t for i, (k, v) in enumerate(zip(proj.keys, proj.values))
               for x, t in (("k", k.contiguous()), ("v", v.contiguous()))}
    save_file(tensors, str(tmp_path / "modes.safetensors"), metadata={"stiefkv": json.dumps(doc)})
    with pytest.raises(CheckpointError, match="layer_key_modes .'post_rope'. beside key_mode 'pre_rope'"):
        Projections.load(tmp_path / "modes.safetensors")
    save_file(tensors, str(tmp_path / "deep.safetensors"), metadata={"stiefkv": "[" * 100000 + "]" * 100000})
    with pytest.raises(CheckpointError, match="damaged StiefKV header"):
        Projections.load(tmp_path / "deep.safetensors")
    with pytest.raises(CheckpointError, match="no readable StiefKV header"):
        Projections.stored_header(tmp_path / "deep.safetensors")


def test_calibration_settings_found_by_a_tester(tmp_path, corpus, fake_loader, caplog):
    """Helper 59: --resume after a finished run calibrated anew over its checkpoint with one INFO line; a
    seed past int64 failed after phase 1 (per-layer seeds overflow) or with torch's traceback; --steps was
    said to have no effect under --profile stiefel, whose profiles it refines; --no-log8 and --no-window8
    under --kernel-storage did nothing, silently."""
    from stiefkv.calibrate.pipeline import CalibrationConfig, unused_settings

    done = tmp_path / "done.safetensors"
    done.write_bytes(b"a finished run's checkpoint")
    result = run(["calibrate", "m", "--data", corpus, "-o", done, "--resume", *CALIBRATE_SMALL], 2)
    assert "nothing to resume" in result.output and "drop --resume" in result.output
    assert not fake_loader.calls and done.read_bytes() == b"a finished run's checkpoint"
    for seed in ("-1", str(2**32), str(2**70)):
        result = run(["calibrate", "m", "--data", corpus, "-o", tmp_path / "x.safetensors", "--seed", seed],
                     2)
        assert f"--seed must be in 0 … 4294967295, got {seed}" in result.output and not fake_loader.calls
    with pytest.raises(ValueError, match="seed must be in 0 … 4294967295"):
        CalibrationConfig.from_kwargs(seed=2**40)
    cfg = CalibrationConfig.from_kwargs(method="pca", profile="stiefel", weighting="output", steps=3)
    assert not [n for n in unused_settings({"steps": 3}, cfg) if "steps" in n]
    cfg = CalibrationConfig.from_kwargs(kernel_storage=True, log8=False, window8=False, budget=0.25)
    notes = " ".join(unused_settings({"log8": False, "window8": False}, cfg))
    assert "log8 has no effect with kernel_storage" in notes and "window8 has no effect" in notes


def test_a_tilde_after_an_equals_sign_is_the_home_folder(tmp_path, monkeypatch):
    """--output=~/x: the shell leaves ~ alone after '='; the check expanded it and the writer did not."""
    import click

    from stiefkv.cli import _output_file

    monkeypatch.setenv("HOME", str(tmp_path))
    param = click.Option(["-o", "--output"])
    assert _output_file(None, param, "~/t.safetensors") == tmp_path / "t.safetensors"


def test_inspect_json_prints_the_header_the_file_holds(tmp_path):
    path = random_projections(tiny_model(), 8, 16).save(tmp_path / "p.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        stored = json.loads(f.metadata()["stiefkv"])
    assert json.loads(run(["inspect", "--json", path], 0).output) == stored


def test_inspect_json_prints_the_header_it_checked(tmp_path, monkeypatch):
    """``inspect --json`` read the header a second time after the check: a file replaced in between (another
    calibration writing there) printed a header nobody checked, beside nothing. One read serves both."""
    import safetensors

    path = random_projections(tiny_model(), 8, 16).save(tmp_path / "p.safetensors")
    checked = Projections.load(path).header()
    other = random_projections(tiny_model(), 16, 8)
    real_open, opened = safetensors.safe_open, []

    def open_then_replace(*args, **kwargs):
        opened.append(args[0])
        handle = real_open(*args, **kwargs)
        other.save(path)  # renamed over the file once it is open: only a second open sees it
        return handle

    monkeypatch.setattr(safetensors, "safe_open", open_then_replace)
    shown = json.loads(run(["inspect", "--json", path], 0).output)
    assert shown["ranks"] == checked["ranks"] == [[8, 16], [8, 16]] and len(opened) == 1


def test_evaluation_refuses_windows_beyond_the_models_positions():
    from stiefkv.evaluate import attention_kl_per_layer, evaluate
    from tests.tiny import random_projections, tiny_model, tiny_tokenizer

    model = tiny_model("llama")  # 512 positions
    proj = random_projections(model, 8, 8)
    with pytest.raises(ValueError, match="window 513 exceeds the model's 512 positions"):
        evaluate(model, tiny_tokenizer(), proj, window=513)
    with pytest.raises(ValueError, match="window must be ≥ 2"):
        evaluate(model, tiny_tokenizer(), proj, window=1)
    with pytest.raises(ValueError, match="context 600 exceeds"):
        attention_kl_per_layer(model, tiny_tokenizer(), proj, context=600)


def test_compact_names_the_options_it_ignores_and_the_checkpoint_by_its_path(tmp_path, fake_loader,
                                                                              monkeypatch, caplog):
    """--window, --batch-size and --backend do nothing with --compact (a kvpress user may take --window for
    the query window), and the result named the checkpoint by its method ("random"), not its file."""
    import stiefkv.longcontext

    seen = {}

    def evaluate_compacted(model, tok, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(stiefkv.longcontext, "evaluate_compacted", evaluate_compacted)
    ckpt = random_projections(tiny_model(), 8, 8).save(tmp_path / "p.safetensors")
    with caplog.at_level(logging.WARNING):
        run(["eval", "m", "--compact", "0.2", "--context", "64", "--projections", ckpt, "--window", "128",
             "--backend", "reference", "--windows", "1"], 2)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "--window has no effect with --compact" in said and "--backend has no effect" in said
    assert "--windows" not in said  # the chunks, with --compact
    assert str(seen["projections"]) == str(ckpt)


# ----------------------------------------------------------------- 17. calibration and evaluation flows


def test_the_default_wikitext_data_is_an_input_an_output_may_not_overwrite(tmp_path, monkeypatch,
                                                                           fake_loader):
    """With --data left at its default the WikiText-2 file it reads was not among the inputs: -o overwrote
    it with a checkpoint (helper 49's walkthrough)."""
    data = tmp_path / "data" / "wikitext-2"
    data.mkdir(parents=True)
    for name in ("wiki.valid.tokens", "wiki.test.tokens", "wiki.train.tokens"):
        (data / name).write_text(" = A = \n some text for the split . \n" * 50)
    monkeypatch.setenv("STIEFKV_DATA_DIR", str(tmp_path / "data"))
    before = (data / "wiki.valid.tokens").read_bytes()
    result = run(["calibrate", "m", "-o", data / "wiki.valid.tokens", *CALIBRATE_SMALL], 2)
    assert "WikiText-2 file" in result.output and (data / "wiki.valid.tokens").read_bytes() == before
    assert not fake_loader.calls  # refused before the model loads


def test_calibration_inputs_that_do_nothing_or_cannot_work_are_said_before_the_work(tmp_path, corpus,
                                                                                    fake_loader, caplog):
    """--plot's format is checked before the calibration (it failed after it); settings with no effect are
    named as the options typed; eval --data self is refused before a model loads; a stale progress file of
    another run is not offered for --resume."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.safetensors"
    result = run(["calibrate", "m", "--data", corpus, "-o", out, "--plot", tmp_path / "x.foo",
                  "--allocation", "dp", "--method", "pca", "--num-sequences", "2", "--seq-len", "17"], 2)
    assert "matplotlib cannot write .foo files" in result.output and not fake_loader.calls
    with caplog.at_level(logging.WARNING):
        run(["calibrate", "m", "--data", corpus, "-o", out, *CALIBRATE_SMALL, "--bits", "16", "--recent",
             "4", "--kl-weight", "0.5", "--step-sequences", "3"], 0)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "--recent has no effect with bf16 latents" in said and "--kl-weight has no effect" in said
    assert "--step-sequences 3 exceeds --num-sequences 2" in said and "step_sequences" not in said
    fake_loader.calls.clear()
    result = run(["eval", "m", "--data", "self", "--windows", "1"], 2)
    assert "--data self samples calibration text" in result.output and not fake_loader.calls
    stale = tmp_path / "q.safetensors.partial"
    stale.write_text("from another run")
    result = run(["calibrate", "m", "--data", corpus, "-o", tmp_path / "q.safetensors", *CALIBRATE_SMALL,
                  "--seq-len", "100000"], 2)
    assert "--resume" not in result.output


def test_evaluate_refuses_a_served_model_and_takes_a_checkpoint_path(tmp_path):
    """evaluate() on a model served by stiefkv.load scored the compressed model as the original."""
    from stiefkv.evaluate import evaluate

    model = tiny_model()
    path = random_projections(model, 8, 16).save(tmp_path / "p.safetensors")
    stiefkv.load(model, path)
    with pytest.raises(ValueError, match="this model is served by stiefkv.load"):
        evaluate(model, CharTokenizer(), path, window=32, limit=1)
    stiefkv.unload(model)
    from stiefkv.evaluate import baseline_projections
    from stiefkv.models import dims_of

    dims = dims_of(model.config)  # a baseline's budget at the window scored, as its bytes a token (was 2048)
    at = baseline_projections(model, "kivi4", context=256)
    assert at.budget == pytest.approx((at.kv_bytes_per_token(256) - 4) / (dims.L * dims.G * 2 * dims.d * 2))
    assert at.budget != baseline_projections(model, "kivi4").budget
    with pytest.raises(DataError):  # the path is read as the checkpoint; then the data is what fails
        evaluate(model, CharTokenizer(), str(path), data=str(tmp_path / "none.txt"), window=32, limit=1)


def test_resume_refuses_another_model_and_takes_what_changes_no_result(tmp_path, corpus):
    """The progress file matched the model by its k_proj/v_proj only: another model of the same keys and
    values was resumed. The same data file named another way, or another batch size, was refused."""
    kw = dict(data=str(corpus), num_sequences=2, seq_len=17, method="pca", allocation="uniform", budget=0.5)
    partial = tmp_path / "p.partial"
    model = tiny_model()
    stiefkv.calibrate(model, CharTokenizer(), progress=partial, **kw)
    other = tiny_model()
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(5)
    with pytest.raises(ValueError, match="written for another model"):
        stiefkv.calibrate(other, CharTokenizer(), progress=partial, resume=True, **kw)
    relative = os.path.relpath(corpus)
    stiefkv.calibrate(model, CharTokenizer(), progress=partial, resume=True, **kw | {"data": relative,
                                                                                    "batch_size": 1})


def test_text_files_may_open_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "hello"}\n')
    assert load_texts(str(path)) == ["hello"]
    txt = tmp_path / "bom.txt"
    txt.write_bytes(b"\xef\xbb\xbfhello")
    assert load_texts(str(txt)) == ["hello"]


def test_a_written_file_keeps_its_link_and_mode_and_a_pipe_is_written_in_place(tmp_path):
    """write_atomically replaced a link by a file (its target unchanged), reset a file's mode, and would have
    replaced /dev/stdout; a read-only folder's failure named the temporary file."""
    from stiefkv.projections import write_atomically

    real = tmp_path / "real.json"
    real.write_text("old")
    real.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_atomically(link, lambda t: t.write_text("new"), "--json")
    assert link.is_symlink() and real.read_text() == "new" and (real.stat().st_mode & 0o777) == 0o640
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    import threading

    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_atomically(fifo, lambda t: t.write_text("through"), "--json")
    reader.join(5)
    assert got == ["through"] and not fifo.is_file()
    # a checkpoint too (helper 59: safetensors' save_file renamed its own temporary file over the pipe, and
    # over /dev/null as root): its bytes go through the pipe, which stays a pipe
    proj = random_projections(tiny_model(), 8, 8)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    proj.save(fifo)
    reader.join(5)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and got and len(got[0]) > 1000
    (tmp_path / "copy.safetensors").write_bytes(got[0])
    assert Projections.load(tmp_path / "copy.safetensors").ranks == proj.ranks


def test_options_are_named_only_where_a_setting_is_meant():
    import click

    from stiefkv.cli import _as_options

    with click.Context(main.commands["calibrate"]):
        assert _as_options("seq_len 5000 exceeds the model") == "--seq-len 5000 exceeds the model"
        assert _as_options("need steps ≥ 0, a finite lr > 0") == "need --steps ≥ 0, a finite --lr > 0"
        said = "steps has no effect with method 'pca'"
        assert _as_options(said) == "--" + said
        for text in ("the 2048-token cache the budget is counted at exact", "the device is busy",
                     "data /tmp/p/seq_len/x.txt is a path"):
            assert _as_options(text) == text
