"""Calibration across processes (torch.distributed, gloo on the CPU): the shard arithmetic, and
``torchrun -m stiefkv calibrate`` with 2 processes against 1 process on the same data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stiefkv.calibrate.distributed import Shard, check_same, init_from_env
from stiefkv.projections import Projections
from tests.utils import corpus_text, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240  # seconds for one launch; a hung rank fails the test instead of the suite


def test_shards_split_the_rows_and_map_global_rows_to_local_ones():
    total, world = 11, 3
    shards = [Shard(r, world, total) for r in range(world)]
    seqs = torch.arange(total)[:, None]
    held = [s.select(seqs)[:, 0].tolist() for s in shards]
    assert sorted(sum(held, [])) == list(range(total))
    assert [s.held() for s in shards] == [4, 4, 3] and [s.held(2) for s in shards] == [1, 1, 0]
    rows = torch.tensor([7, 1, 7, 3, 10, 0])  # repeats and any order, as a minibatch draws them
    for s, mine in zip(shards, held):
        local = s.local(rows)
        assert [mine[i] for i in local.tolist()] == [r for r in rows.tolist() if r % world == s.rank]
    one = Shard(0, 1, total)
    assert not one.active and one.sum(1.5, 2) == (1.5, 2.0) and one.local(rows).tolist() == rows.tolist()


def test_processes_that_disagree_are_named(monkeypatch):
    shard = Shard(0, 2, 8)
    monkeypatch.setattr(Shard, "gather", lambda self, v: [v, v | {"steps": 5}])
    with pytest.raises(ValueError, match=r"different settings: steps=100 on rank 0, 5 on rank 1"):
        check_same(shard, "settings", {"steps": 100, "budget": 0.5})


def test_processes_with_other_models_are_named_by_the_entry_that_differs(monkeypatch):
    """A rank loading the model in bfloat16: the refusal names the fingerprint's entries that differ, not the
    two whole fingerprints (kilobytes of weight samples on one line)."""
    from stiefkv.models import fingerprint
    from tests.tiny import tiny_model

    fp32, bf16 = fingerprint(tiny_model()), fingerprint(tiny_model(dtype=torch.bfloat16))
    monkeypatch.setattr(Shard, "gather", lambda self, v: [v, v | {"model": bf16}])
    with pytest.raises(ValueError) as caught:
        check_same(Shard(0, 2, 8), "model or data", {"model": fp32, "data": "ab12"})
    message = str(caught.value)
    assert "model.kv_weights_dtype='torch.float32' on rank 0, 'torch.bfloat16' on rank 1" in message
    assert len(message) < 600 and "data" not in message.replace("model or data", "")


def test_a_rank_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda on rank 1, which sees no GPU"):
        init_from_env("cuda")
    with pytest.raises(ValueError, match="runs on cuda .NCCL. or cpu .gloo."):
        init_from_env("meta")


def test_a_collective_that_loses_its_peer_is_one_line(monkeypatch):
    """A process killed mid-run: the survivors' all-reduce fails in gloo with a C++ location, advice and an
    emoji. Each survivor says so in one line naming its rank (with the progress file's hint on rank 0), not
    with the backend's traceback."""
    import click

    from stiefkv.calibrate import distributed
    from stiefkv.cli import _run

    def reset(*args, **kwargs):
        raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                           "error [127.0.0.1]:26021: Connection reset by peer. This is typically caused by a "
                           "remote worker hanging or bugs in the application. GLHF! 🏖️")

    monkeypatch.setattr(torch.distributed, "all_reduce", reset)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: "gloo")
    shard = Shard(0, 2, 4)
    with pytest.raises(distributed.PeerLost, match=r"^a sum across the processes failed on rank \? \(Read "
                       r"error \[127.0.0.1\]:26021: Connection reset by peer.\): another process"):
        shard.sum_(torch.ones(3))
    with pytest.raises(click.ClickException) as caught:
        _run(lambda: shard.sum(1.0), False, hint=lambda text: "; progress kept")
    message = caught.value.message
    assert message.startswith("failed (PeerLost): a sum across the processes failed") and "\n" not in message
    assert message.endswith("says why; progress kept") and "GLHF" not in message


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    model = save_tiny_model(root / "model")
    data = root / "calib.txt"
    data.write_text(corpus_text())
    return root, model, data


def launch(nproc: int, args: list[str], script: Path | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(script)] if script else ["-m", "stiefkv"]
    return subprocess.run(cmd + args, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)


def calibrate_args(model: Path, data: Path, out: Path, extra: list[str]) -> list[str]:
    return ["calibrate", str(model), "--data", str(data), "--num-sequences", "7", "--seq-len", "70",
            "--steps", "6", "--step-sequences", "3", "--profile-sequences", "3", "--device", "cpu",
            "-o", str(out)] + extra


# bits auto and the kl profile over anchored storages; bf16 latents and the output profile; int4 and the
# output profile over every storage. With one profile sequence, rank 1 holds none of it.
@pytest.mark.parametrize("extra", [["--budget", "0.1", "--profile-sequences", "1"],
                                   ["--budget", "0.5", "--bits", "16", "--weighting", "output"],
                                   ["--budget", "0.2", "--bits", "4", "--weighting", "output",
                                    "--profile-sequences", "1"]],
                         ids=["auto-kl", "bf16-output", "int4-output"])
def test_two_processes_give_the_checkpoint_of_one(setup, extra):
    root, model, data = setup
    tag = "-".join(extra).replace(".", "")
    one, two = root / f"one{tag}.safetensors", root / f"two{tag}.safetensors"
    r1 = launch(1, calibrate_args(model, data, one, extra))
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = launch(2, calibrate_args(model, data, two, extra))
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert r2.stdout.count("wrote ") == 1  # rank 0 alone reports and writes
    assert not (root / f"two{tag}.safetensors.partial").exists()
    a, b = Projections.load(one), Projections.load(two)
    assert a.ranks == b.ranks and a.specs == b.specs
    d = a.keys[0].shape[1]
    assert any(r < d for pair in a.ranks for r in pair)  # bases that refinement moved, not whole spaces
    assert all(e["rel_error"] > 1e-3 for e in a.errors)
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert torch.isfinite(y).all()
        assert (x - y).abs().max() <= 1e-4
    for ea, eb in zip(a.errors, b.errors):
        assert ea["rel_error"] == pytest.approx(eb["rel_error"], rel=1e-3, abs=1e-6)


def test_more_processes_than_sequences_is_refused(setup):
    root, model, data = setup
    r = launch(2, calibrate_args(model, data, root / "few.safetensors", []) + ["--num-sequences", "1"])
    assert r.returncode != 0
    assert "2 processes but only 1 calibration sequences" in r.stderr
    assert not (root / "few.safetensors").exists()


def test_a_failing_rank_ends_the_run_with_its_message(setup, tmp_path):
    """Rank 1 is given settings of its own: every rank stops with the mismatch named. Then rank 1 alone reads
    a missing data file while rank 0 waits in a collective: the launcher ends the run, with rank 1's error."""
    root, model, data = setup
    script = tmp_path / "per_rank.py"
    script.write_text(
        "import os, sys\n"
        "from stiefkv.cli import main\n"
        "args = sys.argv[1:]\n"
        "if os.environ['RANK'] == '1':\n"
        "    args += os.environ['RANK1_EXTRA'].split()\n"
        "main(args, prog_name='stiefkv')\n")
    args = calibrate_args(model, data, tmp_path / "x.safetensors", [])
    os.environ["RANK1_EXTRA"] = "--steps 5"
    try:
        r = launch(2, args, script)
        assert r.returncode != 0
        assert "different settings: steps=6 on rank 0, 5 on rank 1" in r.stderr
        os.environ["RANK1_EXTRA"] = f"--data {tmp_path / 'missing.txt'}"
        r = launch(2, args, script)
        assert r.returncode != 0
        assert "missing.txt" in r.stderr
    finally:
        del os.environ["RANK1_EXTRA"]
    assert not (tmp_path / "x.safetensors").exists()


def test_an_interrupted_two_process_run_resumes(setup, tmp_path):
    """Interrupted at layer 1's bases, rank 0 keeps the progress file; ``--resume`` with 2 processes again
    finishes it into the checkpoint of an uninterrupted 2-process run."""
    root, model, data = setup
    script = tmp_path / "interrupt.py"
    script.write_text(
        "import sys\n"
        "import stiefkv.calibrate.pipeline as pipeline\n"
        "real = pipeline.fit_layer\n"
        "def fit_layer(layer, data, state, i, *args, **kwargs):\n"
        "    if i == 1:\n"
        "        raise KeyboardInterrupt\n"
        "    return real(layer, data, state, i, *args, **kwargs)\n"
        "pipeline.fit_layer = fit_layer\n"
        "from stiefkv.cli import main\n"
        "main(sys.argv[1:], prog_name='stiefkv')\n")
    out, whole = tmp_path / "r.safetensors", tmp_path / "whole.safetensors"
    extra = ["--budget", "0.1"]
    r = launch(2, calibrate_args(model, data, out, extra), script)
    assert r.returncode != 0  # (the hint may not print: the launcher stops rank 0 once rank 1 has exited)
    assert (tmp_path / "r.safetensors.partial").is_file() and not out.exists()
    r = launch(2, calibrate_args(model, data, out, extra) + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert launch(2, calibrate_args(model, data, whole, extra)).returncode == 0
    a, b = Projections.load(out), Projections.load(whole)
    assert a.ranks == b.ranks and a.specs == b.specs
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert (x - y).abs().max() <= 1e-6


def test_a_stopped_run_says_where_its_progress_is(setup, tmp_path):
    """Ctrl-C under torchrun: the agent sends each process SIGTERM right after SIGINT. Rank 0 (here signalling
    itself at layer 1's bases) reports the interruption and the progress file in one line, as one process
    does, instead of dying of the signal without a word."""
    root, model, data = setup
    script = tmp_path / "sigterm.py"
    script.write_text(
        "import os, signal, sys\n"
        "import stiefkv.calibrate.pipeline as pipeline\n"
        "real = pipeline.fit_layer\n"
        "def fit_layer(layer, data, state, i, *args, **kwargs):\n"
        "    if i == 1 and os.environ['RANK'] == '0':\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(layer, data, state, i, *args, **kwargs)\n"
        "pipeline.fit_layer = fit_layer\n"
        "from stiefkv.cli import main\n"
        "main(sys.argv[1:], prog_name='stiefkv')\n")
    out = tmp_path / "s.safetensors"
    r = launch(2, calibrate_args(model, data, out, ["--budget", "0.5", "--bits", "16"]), script)
    assert r.returncode != 0 and not out.exists()
    partial = tmp_path / "s.safetensors.partial"
    assert f"Error: interrupted; the progress so far is kept in {partial}: rerun with --resume" in r.stderr
    assert "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr


# ------------------------------------------------------------------------- one model over several devices
CALIB = {"num_sequences": 5, "seq_len": 70, "steps": 6, "step_sequences": 2, "profile_sequences": 2,
         "budget": 0.1, "seed": 3}


def calibrate_tiny(devices: list[str] | None, data: Path):
    import stiefkv
    from tests.tiny import tiny_model
    from tests.utils import CharTokenizer

    model = tiny_model(layers=3)
    if devices:
        stiefkv.place_layers(model, devices)
    return stiefkv.calibrate(model, CharTokenizer(), data=str(data), **CALIB)


def test_placing_layers_is_checked_and_leaves_a_one_device_calibration_unchanged(setup, monkeypatch):
    import stiefkv
    import stiefkv.calibrate.pipeline as pipeline
    from tests.tiny import tiny_model

    _, _, data = setup
    a, b = calibrate_tiny(None, data), calibrate_tiny(["cpu", "cpu"], data)
    assert a.ranks == b.ranks and all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))
    with pytest.raises(ValueError, match="4 devices for 3 layers"):
        stiefkv.place_layers(tiny_model(layers=3), ["cpu"] * 4)
    monkeypatch.setattr(pipeline, "layer_devices", lambda m: [torch.device("cpu"), torch.device("cuda", 0)])
    with pytest.raises(ValueError, match="--data self samples text with the whole model's forward"):
        stiefkv.calibrate(tiny_model(layers=3), None, data="self", **CALIB)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (layers over a GPU and the CPU)")
def test_layers_over_a_gpu_and_the_cpu_calibrate_as_on_one_device(setup):
    """The first layers on the GPU, the rest and the LM head on the CPU: activations cross between them in
    the profiles' model tails and the layer-by-layer passes. Float32 on both (no TF32)."""
    _, _, data = setup
    a, b = calibrate_tiny(None, data), calibrate_tiny(["cuda:0", "cpu"], data)
    assert a.ranks == b.ranks and a.specs == b.specs
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert (x - y.cpu()).abs().max() <= 1e-3


def test_eigenvector_signs_do_not_depend_on_the_solver():
    """eigh may return any sign per eigenvector (it differs between a GPU and a CPU): the bases do not."""
    from stiefkv.calibrate.pca import top_eigenvectors

    x = torch.randn(3, 200, 13, dtype=torch.float64)
    moment = x.transpose(1, 2) @ x
    flip = torch.tensor([1.0, -1.0] * 6 + [-1.0], dtype=torch.float64)
    real_eigh = torch.linalg.eigh

    def flipped_eigh(m):
        vals, vecs = real_eigh(m)
        return vals, vecs * flip

    a = top_eigenvectors(moment, 7)
    torch.linalg.eigh = flipped_eigh
    try:
        b = top_eigenvectors(moment, 7)
    finally:
        torch.linalg.eigh = real_eigh
    assert torch.equal(a, b)
    assert (a.gather(-2, a.abs().argmax(-2, keepdim=True)) > 0).all()  # each column's largest entry
