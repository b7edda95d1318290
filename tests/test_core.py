"""Checkpoint format, PCA calibration, data sources, model loading errors and the CLI (tiny models)."""

import json
import logging

import pytest
import torch
from click.testing import CliRunner

import stiefkv
from stiefkv.calibrate.allocate import uniform
from stiefkv.calibrate.pca import top_eigenvectors
from stiefkv.cli import main
from stiefkv.data import DataError, calibration_sequences, load_texts
from stiefkv.models import ModelLoadError, arch_of, fingerprint, same_model
from stiefkv.projections import CheckpointError
from tests.tiny import ARCHS, random_projections, tiny_config, tiny_model
from tests.utils import CharTokenizer

# ---------------------------------------------------------------------------------------- checkpoint


def test_save_load_roundtrip(tmp_path):
    model = tiny_model("qwen3")
    proj = random_projections(model, 8, 16, "post_rope")
    proj.errors = [{"layer": i, "rel_error": 0.1 * i, "cosine": 0.9} for i in range(2)]
    path = proj.save(tmp_path / "p.safetensors")
    back = stiefkv.Projections.load(path)
    assert back.ranks == [(8, 16), (8, 16)] and back.key_mode == "post_rope"
    assert back.fingerprint == proj.fingerprint and back.errors == proj.errors
    for a, b in zip(proj.keys + proj.values, back.keys + back.values):
        assert torch.equal(a, b)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    back.check(model)


def test_key_modes_per_layer_round_trip(tmp_path):
    """Layers of different key modes are kept through a save (format version 9); one mode for every layer
    is the plain form, and a list of the wrong length or an unknown mode is refused."""
    model = tiny_model("llama", layers=3)
    proj = random_projections(model, 24, 8, "pre_rope")
    mixed = stiefkv.Projections(keys=proj.keys, values=proj.values, key_mode="pre_rope",
                                layer_key_modes=["pre_rope", "post_rope", "post_rope"],
                                fingerprint=proj.fingerprint, budget=0.5)
    back = stiefkv.Projections.load(mixed.save(tmp_path / "m.safetensors"))
    assert back.key_modes == ["pre_rope", "post_rope", "post_rope"] and back.format_version == 9
    assert back.key_mode_summary == "post_rope (layers 1, 2), pre_rope (layer 0)"
    uniform = stiefkv.Projections(keys=proj.keys, values=proj.values, key_mode="pre_rope",
                                  layer_key_modes=["post_rope"] * 3, fingerprint=proj.fingerprint, budget=0.5)
    assert uniform.key_mode == "post_rope" and uniform.layer_key_modes is None
    assert uniform.format_version == 2 and uniform.key_mode_summary == "post_rope"
    for modes in (["pre_rope"] * 2, ["pre_rope", "post_rope", "sideways"]):
        with pytest.raises(CheckpointError, match="layer_key_modes must give one of"):
            stiefkv.Projections(keys=proj.keys, values=proj.values, key_mode="pre_rope",
                                layer_key_modes=modes, fingerprint=proj.fingerprint, budget=0.5)


def test_load_checks_projections_edited_after_construction():
    """Projections' fields are checked when it is made; edited afterwards (they are plain attributes), they
    reached stiefkv.load unchecked and failed inside it (an IndexError, a str without .quantized) or later.
    load checks them as construction does, and leaves the model unserved."""
    from stiefkv.attention import is_compressed
    from stiefkv.quant import QuantSpec

    int4 = QuantSpec(4, "token")
    edits = {"layer_key_modes must give one of": lambda p: setattr(p, "layer_key_modes", ["pre_rope"]),
             "key_mode must be one of": lambda p: setattr(p, "key_mode", "sideways"),
             "2 key bases but 1 value bases": lambda p: p.values.pop(),
             "1 layers of storage specs for 2 layers": lambda p: setattr(p, "quant", [(int4, int4)]),
             "a string for a layer": lambda p: setattr(p, "quant", ["int4-token"] * 2)}
    for message, edit in edits.items():
        model = tiny_model()
        proj = random_projections(model, 8, 8)
        edit(proj)
        with pytest.raises(CheckpointError, match=message):
            stiefkv.load(model, proj)
        assert not is_compressed(model)
    # an edit construction would take is read as construction reads it
    model = tiny_model()
    proj = random_projections(model, 8, 8)
    proj.quant = [("int4-token", "bf16")] * 2
    stiefkv.load(model, proj)
    assert proj.specs == [(int4, QuantSpec())] * 2


def test_header_is_json_without_pickle(tmp_path):
    from safetensors import safe_open

    path = random_projections(tiny_model(), 8, 8).save(tmp_path / "p.safetensors")
    with safe_open(str(path), "pt") as f:
        doc = json.loads(f.metadata()["stiefkv"])
    assert doc["format_version"] == 2 and doc["ranks"] == [[8, 8], [8, 8]]
    assert set(doc["fingerprint"]) >= {"architecture", "L", "H", "G", "d", "D", "rope", "kv_weights_sha256"}


def test_mismatched_model_is_refused_with_the_difference(tmp_path):
    path = random_projections(tiny_model("llama", kv_heads=2), 8, 8).save(tmp_path / "p.safetensors")
    with pytest.raises(CheckpointError, match=r"G: checkpoint 2, model 3"):
        stiefkv.load(tiny_model("llama", kv_heads=3), path)
    other = tiny_model("llama", kv_heads=2)
    with torch.no_grad():
        other.model.layers[0].self_attn.k_proj.weight.add_(0.5)
    with pytest.raises(CheckpointError, match="different k_proj/v_proj weights"):
        stiefkv.load(other, path)


def test_a_model_differing_only_in_its_kv_biases_is_refused(tmp_path, caplog):
    """Qwen2's k_proj and v_proj have biases, which shift every key and value the bases were fitted to; the
    fingerprint hashed the weights only, so a checkpoint loaded on a model differing in those biases alone.
    Checkpoints written before (no ``kv_biases`` in the fingerprint) still load, on their weights."""
    from stiefkv.projections import Projections

    model = tiny_model("qwen2")
    assert model.model.layers[0].self_attn.k_proj.bias is not None
    path = random_projections(model, 8, 8).save(tmp_path / "p.safetensors")
    for name in ("k_proj", "v_proj"):
        other = tiny_model("qwen2")
        with torch.no_grad():
            getattr(other.model.layers[1].self_attn, name).bias.add_(0.5)
        with pytest.raises(CheckpointError, match="different k_proj/v_proj weights or biases"):
            stiefkv.load(other, path)
        assert not same_model(fingerprint(other), fingerprint(model))
    stiefkv.load(tiny_model("qwen2").to(torch.bfloat16), path)  # the biases round as the weights do
    assert Projections.load(path).format_version == 10  # older readers say "upgrade", not "another model"
    # a checkpoint as earlier versions wrote it: weights only, checked so
    old = random_projections(model, 8, 8)
    old.fingerprint = fingerprint(model, biases=False)
    assert "kv_biases" not in old.fingerprint and old.format_version == 2
    with caplog.at_level(logging.INFO, logger="stiefkv.projections"):
        stiefkv.load(tiny_model("qwen2"), old.save(tmp_path / "old.safetensors"))
    assert "checked against the model's k_proj/v_proj weights only" in caplog.text  # said, not silent
    # a model without k/v biases has the fingerprint it always had
    llama = tiny_model("llama")
    assert fingerprint(llama) == fingerprint(llama, biases=False)


def test_a_progress_file_from_before_the_kv_biases_resumes(tmp_path):
    """A calibration of a model with k/v biases interrupted before fingerprints covered them resumes: its
    progress file is compared on the weights it recorded (found by the review: refused as another model).
    Another model is still refused."""
    import functools

    from stiefkv.calibrate.state import CalibrationState
    from stiefkv.models import fingerprint_like

    model = tiny_model("qwen2")
    path = tmp_path / "p.partial"
    CalibrationState(settings={"budget": 0.5}, fingerprint=fingerprint(model, biases=False)).save(path)
    with pytest.raises(ValueError, match="written for another model"):  # the fingerprint of now alone
        CalibrationState.load(path, {"budget": 0.5}, fingerprint(model))
    settings = {"budget": 0.5}
    CalibrationState.load(path, settings, fingerprint(model), functools.partial(fingerprint_like, model))
    other = tiny_model("qwen2")
    with torch.no_grad():
        other.model.layers[0].self_attn.k_proj.weight.add_(0.5)
    like = functools.partial(fingerprint_like, other)
    with pytest.raises(ValueError, match="written for another model"):
        CalibrationState.load(path, {"budget": 0.5}, fingerprint(other), like)


def test_fingerprint_survives_bf16():
    model = tiny_model("llama")
    cast = fingerprint(tiny_model("llama").to(torch.bfloat16))
    assert fingerprint(model)["kv_weights_sha256"] == cast["kv_weights_sha256"] and same_model(
        fingerprint(model), cast)


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all",
                                     b"\x10\x00\x00\x00\x00\x00\x00\x00{}"])
def test_corrupt_file_is_refused(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError):
        stiefkv.Projections.load(path)


def test_foreign_safetensors_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "f.safetensors"))
    with pytest.raises(CheckpointError, match="not a StiefKV checkpoint"):
        stiefkv.Projections.load(tmp_path / "f.safetensors")


# --------------------------------------------------------------------------------------- calibration


def test_uniform_allocation():
    assert uniform(3, 0.5, 64) == [(32, 32)] * 3
    assert uniform(2, 0.375, 64) == [(24, 24)] * 2
    assert uniform(2, 1.0, 24) == [(24, 24)] * 2
    for bad in (0, -0.1, 1.01):
        with pytest.raises(ValueError, match="budget"):
            uniform(2, bad, 64)


def test_top_eigenvectors_orthonormal_and_optimal():
    x = torch.randn(500, 24, dtype=torch.float64) * torch.linspace(3, 0.1, 24, dtype=torch.float64)
    moment = (x.T @ x)[None]
    P = top_eigenvectors(moment, 8)[0].double()
    assert torch.allclose(P.T @ P, torch.eye(8, dtype=torch.float64), atol=1e-6)
    err = (x - x @ P @ P.T).pow(2).sum()
    Q = torch.linalg.qr(torch.randn(24, 8, dtype=torch.float64))[0]
    assert err <= (x - x @ Q @ Q.T).pow(2).sum()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_pca_calibration_end_to_end(arch, key_mode, corpus, tmp_path):
    model = tiny_model(arch)
    proj = stiefkv.calibrate(model, CharTokenizer(), budget=0.5, key_mode=key_mode, data=str(corpus),
                             method="pca", allocation="uniform", num_sequences=6, seq_len=33, batch_size=4,
                             seed=3)
    assert proj.ranks == [(8, 8)] * 2 and proj.achieved_budget == pytest.approx(1 / 3)
    for P in proj.keys + proj.values:
        eye = torch.eye(P.shape[-1]).expand(P.shape[0], -1, -1)
        assert torch.allclose(P.transpose(1, 2) @ P, eye, atol=1e-5)
    # rank 8 of d = 24: measured rel. error 0.23-0.35, cosine 0.94-0.97 over the architectures and key modes
    assert all(0.15 < e["rel_error"] < 0.45 and 0.9 < e["cosine"] < 1 for e in proj.errors)
    assert proj.settings["tokens"] == 6 * 33 and proj.method == "pca"
    path = proj.save(tmp_path / "p.safetensors")
    stiefkv.load(model, path)
    assert torch.isfinite(model(torch.randint(0, 97, (1, 9))).logits).all()


def test_pca_at_full_budget_has_zero_error(corpus):
    proj = stiefkv.calibrate(tiny_model(), CharTokenizer(), budget=1.0, data=str(corpus), num_sequences=2,
                             seq_len=17, method="pca", allocation="uniform")
    assert all(e["rel_error"] < 1e-5 for e in proj.errors)


def test_pca_beats_random_bases(corpus):
    model = tiny_model()
    proj = stiefkv.calibrate(model, CharTokenizer(), budget=0.5, method="pca", allocation="uniform",
                             order="independent", data=str(corpus), num_sequences=4, seq_len=33)
    seqs = calibration_sequences(model, CharTokenizer(), data=str(corpus), num_sequences=4, seq_len=33)
    from stiefkv.calibrate.collect import LayerInputs
    from stiefkv.calibrate.objective import ErrorStats, compressed_layer_output
    from stiefkv.models import rope_spec

    rnd = random_projections(model, 8, 8)
    inputs = LayerInputs(model, seqs)
    target = inputs.run()
    stats = ErrorStats()
    with torch.no_grad():
        for b in inputs.batches(target):
            stats.add(compressed_layer_output(inputs.layers[0], b, rnd.keys[0], rnd.values[0],
                                              key_mode="pre_rope", rope=rope_spec(model.config)), b.output)
    assert proj.errors[0]["rel_error"] < stats.rel_error


def test_calibration_is_deterministic(corpus):
    kw = dict(budget=0.5, data=str(corpus), num_sequences=3, seq_len=17, seed=7, steps=5, step_sequences=1)
    a = stiefkv.calibrate(tiny_model(), CharTokenizer(), **kw)
    b = stiefkv.calibrate(tiny_model(), CharTokenizer(), **kw)
    assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


def test_calibrate_rejects_bad_settings():
    with pytest.raises(ValueError, match="budget"):
        stiefkv.calibrate(tiny_model(), CharTokenizer(), budget=0)
    with pytest.raises(ValueError, match="method"):
        stiefkv.calibrate(tiny_model(), CharTokenizer(), method="svd")
    with pytest.raises(TypeError, match="unknown calibration settings"):
        stiefkv.calibrate(tiny_model(), CharTokenizer(), rank=3)
    # a setting of the wrong type: "false" is true to Python, "20" steps would compare as text
    for bad, message in [(dict(kernel_storage="false"), "kernel_storage must be True or False, got 'false'"),
                         (dict(steps="20"), "steps must be an integer, got '20'"),
                         (dict(steps=2.5), "steps must be an integer"),
                         (dict(lr="1e-3"), "lr must be a number"),
                         (dict(budget=True), "budget must be a number"), (dict(method=3), "method must be")]:
        with pytest.raises(TypeError, match=message):
            stiefkv.calibrate(tiny_model(), CharTokenizer(), **bad)


# ---------------------------------------------------------------------------------------------- data


def test_data_sources(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.jsonl").write_text('{"text": "beta"}\n\n{"text": "gamma"}\n')
    assert load_texts(str(tmp_path / "a.txt")) == ["alpha"]
    assert load_texts(str(tmp_path)) == ["alpha", "beta", "gamma"]
    (tmp_path / "c.jsonl").write_text('{"body": 1}\n')
    with pytest.raises(DataError, match="c.jsonl:1"):
        load_texts(str(tmp_path / "c.jsonl"))
    with pytest.raises(DataError, match="not 'wikitext2'"):
        load_texts(str(tmp_path / "missing.txt"))


def test_wikitext_reads_the_right_split(monkeypatch, tmp_path):
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "wiki.valid.tokens").write_text("VALID")
    (tmp_path / "wikitext-2" / "wiki.test.raw").write_text("TEST")
    monkeypatch.setenv("STIEFKV_DATA_DIR", str(tmp_path))
    assert load_texts("wikitext2", "calibration") == ["VALID"]
    assert load_texts("wikitext2", "test") == ["TEST"]


def test_too_little_data_is_a_clear_error(corpus):
    with pytest.raises(DataError, match="lower --num-sequences"):
        calibration_sequences(tiny_model(), CharTokenizer(), data=str(corpus), num_sequences=10_000,
                              seq_len=64)


def test_self_data_samples_from_the_model(caplog):
    seqs = calibration_sequences(tiny_model(), CharTokenizer(), data="self", num_sequences=3, seq_len=9)
    assert seqs.shape == (3, 9) and "sampled from the model itself" in caplog.text


def test_self_data_starts_at_the_models_bos_when_the_tokenizer_names_none():
    """Found by a tester: a tokenizer with neither BOS nor EOS failed in torch.full (fill_value None) though
    the model's config names a BOS."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
    assert bare.bos_token_id is None and bare.eos_token_id is None
    model = tiny_model()
    model.config.bos_token_id, model.generation_config.bos_token_id = 5, None
    seqs = calibration_sequences(model, bare, data="self", num_sequences=2, seq_len=6)
    assert seqs.shape == (2, 6) and bool((seqs[:, 0] == 5).all())
    model.config.bos_token_id = model.config.eos_token_id = None
    model.generation_config.bos_token_id = model.generation_config.eos_token_id = None
    with pytest.raises(DataError, match="neither the tokenizer nor the model's config names one"):
        calibration_sequences(model, bare, data="self", num_sequences=2, seq_len=6)
    model.generation_config.eos_token_id = [500, 2]
    with pytest.raises(DataError, match=r"token 500 \(BOS or EOS\), outside the model's vocabulary"):
        calibration_sequences(model, bare, data="self", num_sequences=2, seq_len=6)


# -------------------------------------------------------------------------------------------- models


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config

    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        arch_of(GPT2Config())
    with pytest.raises(ModelLoadError, match="sliding"):
        arch_of(tiny_config("mistral").__class__(sliding_window=64))


def test_configs_whose_attention_is_full_are_accepted_and_windows_that_bind_are_not():
    """Found by a tester: arch_of refused a Qwen2 config whose layer_types are all full attention (a window
    in no layer: max_window_layers = the layers) and a Mistral whose window is not smaller than its
    positions."""
    from transformers import AutoConfig

    def qwen2(window_from: int):
        return AutoConfig.for_model("qwen2", num_hidden_layers=2, use_sliding_window=True, sliding_window=64,
                                    max_window_layers=window_from)

    assert arch_of(qwen2(2)).name == "qwen2"
    assert arch_of(AutoConfig.for_model("mistral", sliding_window=512, max_position_embeddings=512)).name
    with pytest.raises(ModelLoadError, match="qwen2 with sliding_attention layers"):
        arch_of(qwen2(1))
    with pytest.raises(ModelLoadError, match=r"mistral with a sliding attention window \(511\)"):
        arch_of(AutoConfig.for_model("mistral", sliding_window=511, max_position_embeddings=512))
    full_window = AutoConfig.for_model("qwen3", num_hidden_layers=2, use_sliding_window=True,
                                       sliding_window=512, max_position_embeddings=512, max_window_layers=1)
    assert "sliding_attention" in full_window.layer_types and arch_of(full_window).name == "qwen3"


def test_local_folder_loads(tmp_path):
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, "<unk>")))
    tok.eos_token = "a"
    tok.save_pretrained(tmp_path)
    loaded, tok2 = stiefkv.load_model(str(tmp_path))
    assert loaded.config.model_type == "qwen2" and tok2.padding_side == "left"
    assert fingerprint(loaded) == fingerprint(model)


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load model"):
        stiefkv.load_model("no-such-org/no-such-model-xyz")
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        stiefkv.load_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="does not exist"):
        stiefkv.load_model(str(tmp_path / "m.gguf"))


# ----------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("args, message", [
    (["calibrate", "smollm2", "--budget", "1.5", "-o", "x.safetensors"], "budget must be in (0, 1]"),
    (["calibrate", "smollm2", "--budget", "0", "-o", "x.safetensors"], "budget must be in (0, 1]"),
    (["calibrate", "no-such-model-xyz", "-o", "x.safetensors"], "cannot load model"),
    (["inspect", "missing.safetensors"], "does not exist"),
    (["eval", "smollm2", "--projections", "missing.safetensors"], "does not exist"),
    (["eval", "smollm2", "--windows", "0"], "--windows must be ≥ 1"),
])
def test_cli_bad_input_gives_one_line(args, message):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1


def test_cli_inspect(tmp_path):
    path = random_projections(tiny_model(), 8, 16).save(tmp_path / "p.safetensors")
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 0 and "| 1 | 8 × bf16 | 16 × bf16 | 96.0 |" in result.output
    result = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert json.loads(result.output)["ranks"] == [[8, 16], [8, 16]]


def test_cli_inspect_shows_ranks_bits_and_bytes_of_a_quantized_checkpoint(tmp_path):
    from dataclasses import replace

    from stiefkv.quant import QuantSpec

    k = QuantSpec(4, "channel", recent=16)
    v = QuantSpec(2, "token", log8=True, recent=8, window8=True)
    proj = random_projections(tiny_model(), 8, 16)
    path = replace(proj, quant=[(k, v)] * len(proj.ranks)).save(tmp_path / "q.safetensors")
    result = CliRunner().invoke(main, ["inspect", str(path)])
    # by hand, a 2048-token cache of one head: keys hold 1984 tokens as int4 codes of 8 channels (4 B each),
    # 31 groups of 64 tokens with a float16 scale and low per channel (32 B each), 64 exact bf16 tokens
    # (16 B); values hold 2040 tokens as int2 codes of 16 channels (4 B) and a log8 byte, 8 exact in int8
    # (16 B + a log8 byte)
    key_bytes = (1984 * 4 + 31 * 32 + 64 * 16) / 2048
    value_bytes = (2040 * (4 + 1) + 8 * 17) / 2048
    layer = 2 * (key_bytes + value_bytes)  # G = 2 heads
    assert result.exit_code == 0, result.output
    assert f"| 1 | 8 × int4-channel-r16 | 16 × int2-token-log8-r8-w8 | {layer:.1f} |" in result.output
    assert f"KV cache: {2 * layer + 4:.1f} bytes per token" in result.output  # + the int32 position


def test_cli_help_explains_options():
    result = CliRunner().invoke(main, ["calibrate", "--help"])
    for option in ("--budget", "--method", "--key-mode", "--data", "--num-sequences", "--seq-len", "--device",
                   "--dtype", "--seed"):
        assert option in result.output


def test_public_calibrate_is_callable_after_importing_its_submodules():
    import stiefkv.calibrate.pipeline  # noqa: F401  (importing submodules must not shadow the function)

    assert callable(stiefkv.calibrate)
    seqs = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    proj = stiefkv.calibrate(tiny_model(), None, sequences=seqs, budget=0.5, method="pca",
                             allocation="uniform")
    assert proj.ranks == [(8, 8)] * 2


def test_python_dash_m_runs_the_cli(tmp_path):
    """``python -m stiefkv`` is the ``stiefkv`` command (what ``torchrun -m stiefkv`` launches): the same
    commands, and the same one-line error and exit status on bad input."""
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "stiefkv", "--help"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and "calibrate" in ok.stdout and "Usage: stiefkv" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "stiefkv", "inspect", str(tmp_path / "missing.safetensors")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "missing.safetensors" in bad.stderr + bad.stdout


def test_a_float32_checkpoint_loads_on_the_float16_model(tmp_path):
    """bf16(fp16(w)) differs from bf16(w) for some weights, so the float16 model's bf16 hash missed the
    float32 calibration's: the checkpoint also records the hash through float16, and either matching is
    enough. A checkpoint without it (older) is refused on float16 with the way out named."""
    import torch

    import stiefkv
    from stiefkv.models import weights_hash
    from tests.tiny import random_projections, tiny_model

    model = tiny_model()
    with torch.no_grad():  # weights where the two roundings disagree
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight
            w.copy_(torch.linspace(1.0, 1.01, w.numel()).reshape(w.shape) * torch.sign(w))
    half = tiny_model()
    half.load_state_dict(model.state_dict())
    half.half()
    assert weights_hash(half) != weights_hash(model)  # the case this is about
    proj = random_projections(model, 8, 8)
    path = proj.save(tmp_path / "p.safetensors")
    stiefkv.load(half, stiefkv.Projections.load(path))
    old = stiefkv.Projections.load(path)
    old.fingerprint.pop("kv_weights_sha256_fp16")
    old.fingerprint.pop("kv_weights_sample")
    with pytest.raises(stiefkv.CheckpointError, match="load the model in float32, stiefkv.load it"):
        stiefkv.load(stiefkv.unload(half), old)
    stiefkv.load(model, old)  # float32 still matches the bf16 hash


def test_a_checkpoint_of_bf16_weights_loads_on_their_float16_cast_and_back(tmp_path):
    """bf16(fp16(w)) is neither bf16(w) nor bf16(fp16(bf16(w))) for some weights, so no hash of rounded
    weights matched a bf16 model's checkpoint on the float16 model (or the reverse); samples of the weights
    do, and still tell other weights apart."""
    import torch

    import stiefkv
    from stiefkv.models import fingerprint, same_weights
    from tests.tiny import random_projections, tiny_model

    model = tiny_model()
    with torch.no_grad():  # weights whose two roundings disagree
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight
            w.copy_(torch.linspace(1.0, 1.01, w.numel()).reshape(w.shape) * torch.sign(w) * 0.07)
    brain, half = tiny_model(), tiny_model()
    for m, dtype in ((brain, torch.bfloat16), (half, torch.float16)):
        m.load_state_dict(model.state_dict())
        m.to(dtype)
    fb, fh = fingerprint(brain), fingerprint(half)
    assert not {fb["kv_weights_sha256"], fb["kv_weights_sha256_fp16"]} & {fh["kv_weights_sha256"],
                                                                          fh["kv_weights_sha256_fp16"]}
    for made_on, served_on in ((brain, half), (half, brain)):
        path = random_projections(made_on, 8, 8).save(tmp_path / "p.safetensors")
        stiefkv.load(served_on, path)
        stiefkv.unload(served_on)
    for change in ("scale", "rows"):  # near copies: within a percent, or a quarter of one matrix's rows
        other = tiny_model()
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            w = other.model.layers[1].self_attn.v_proj.weight
            if change == "scale":
                w.mul_(1.01)
            else:
                w[: w.shape[0] // 4] = torch.randn_like(w[: w.shape[0] // 4]) * 0.02
        other.to(torch.float16)
        assert not same_weights(fingerprint(other), fb), change
        with pytest.raises(stiefkv.CheckpointError, match="different k_proj/v_proj weights"):
            stiefkv.load(other, random_projections(brain, 8, 8))
    # a float32 model compares by hashes only: a sample within rounding is not enough there
    near = tiny_model()
    near.load_state_dict(model.state_dict())
    with torch.no_grad():
        near.model.layers[0].self_attn.k_proj.weight.mul_(1.001)
    assert not same_weights(fingerprint(near), fb)


def test_an_edited_header_is_refused(tmp_path):
    """The tensors had a checksum, the header none: a key mode or storage edited in the JSON was served
    silently (the bases read as another mode). A header without its hash (older files) still loads."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tests.tiny import random_projections, tiny_model

    path = random_projections(tiny_model(), 8, 8).save(tmp_path / "p.safetensors")
    with safe_open(str(path), framework="pt") as f:
        doc, tensors = json.loads(f.metadata()["stiefkv"]), {k: f.get_tensor(k) for k in f.keys()}
    for edit in ({"key_mode": "post_rope" if doc["key_mode"] == "pre_rope" else "pre_rope"}, {"budget": 0.9}):
        save_file(tensors, str(tmp_path / "e.safetensors"), metadata={"stiefkv": json.dumps({**doc, **edit})})
        with pytest.raises(CheckpointError, match="its header does not match the sha256 it carries"):
            stiefkv.Projections.load(tmp_path / "e.safetensors")
    older = {k: v for k, v in doc.items() if k != "header_sha256"}
    save_file(tensors, str(tmp_path / "o.safetensors"), metadata={"stiefkv": json.dumps(older)})
    assert stiefkv.Projections.load(tmp_path / "o.safetensors").key_mode == doc["key_mode"]


def test_storage_specs_may_be_given_as_text():
    """``Projections(quant=[("int4-token", "int4-token")] * L)`` failed inside with an AttributeError."""
    import torch

    from stiefkv.quant import QuantSpec
    from tests.tiny import random_projections, tiny_model

    base = random_projections(tiny_model(), 8, 8)
    kw = dict(keys=base.keys, values=base.values, key_mode=base.key_mode, fingerprint=base.fingerprint,
              budget=0.3)
    proj = stiefkv.Projections(**kw, quant=[("int4-token", "bf16")] * len(base.keys))
    assert proj.specs[0] == (QuantSpec(4, "token"), QuantSpec())
    for bad, message in (([("int4token!", "bf16")] * 2, "not a latent storage spec"),
                         ([(4, 4)] * 2, "got int"), ([("int4-token",)] * 2, "pair")):
        with pytest.raises(CheckpointError, match=message):
            stiefkv.Projections(**kw, quant=bad)
    assert torch.equal(proj.keys[0], base.keys[0])


def test_spaced_indices_stay_inside_large_tensors():
    """A float32 linspace put the last of 32 indices of a 28,311,552-element embedding at 28,311,552 (one
    past the end): the quickstart's calibration failed there."""
    from stiefkv.models import spaced

    for n in (1, 2, 7, 2 ** 24 + 3, 28_311_552, 10 ** 10):
        idx = spaced(n, 32)
        assert idx[0] == 0 and idx[-1] == n - 1 and bool((idx[1:] > idx[:-1]).all())
        assert len(idx) == min(32, n)
