"""The ``stiefkv`` command line: it parses options and calls the public API, nothing more.

Defaults come from :class:`stiefkv.CalibrationConfig`. Every user error ends in one line on stderr and
exit status 2 (bad input) or 1 (failure), never a traceback; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import fields
from pathlib import Path

import click

from stiefkv.calibrate.allocate import ALLOCATIONS
from stiefkv.calibrate.pipeline import (
    BITS_CHOICES,
    CALIBRATION_KEY_MODES,
    CPU_SIZES,
    LOSSES,
    METHODS,
    ORDERS,
    PROFILES,
    SEED_MAX,
    SMALL_BUDGET,
    SMALL_BUDGET_RECENT,
    CalibrationConfig,
)
from stiefkv.calibrate.profile import WEIGHTINGS
from stiefkv.data import check_data
from stiefkv.quant import DEFAULT_RECENT, GROUP

DEFAULTS = {f.name: f.default for f in fields(CalibrationConfig)}
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
log = logging.getLogger("stiefkv")

# compressed-context perplexity: AM, eviction by its queries, and kvpress's presses (stiefkv.presses)
COMPACT_METHODS = ["am", "attention", "knorm", "snapkv", "tova", "streaming_llm", "expected_attention",
                   "recent", "random"]


class UserError(click.ClickException):
    exit_code = 2


def _user_errors():
    from stiefkv.data import DataError
    from stiefkv.models import ModelLoadError
    from stiefkv.projections import CheckpointError

    return ModelLoadError, DataError, CheckpointError, ValueError, FileNotFoundError


def _failures():
    """Errors that are not the input's fault but still deserve one line, exit status 1, and no traceback."""
    import torch

    return OSError, torch.linalg.LinAlgError, torch.cuda.OutOfMemoryError


def _run(fn, debug: bool, hint=None):
    """Call ``fn``; turn the errors a user can fix into one line (exit 2), failures into one line (exit 1).

    ``hint(text)`` is appended to the message ``text`` (e.g. where the progress of a failed calibration was
    kept, unless the message is about that file already).
    """
    def message(text: str) -> str:
        extra = hint(text) if hint is not None else ""
        return f"{text}{extra}"

    try:
        return fn()
    except _user_errors() as exc:
        if debug:
            raise
        raise UserError(message(_as_options(str(exc)))) from None
    except _failures() as exc:
        if debug:
            raise
        if isinstance(exc, OSError) and exc.strerror:
            text = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
        else:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise click.ClickException(message(f"failed ({type(exc).__name__}): {text}")) from None
    except KeyboardInterrupt:
        raise click.ClickException(message("interrupted")) from None


def _as_options(text: str) -> str:
    """A message from the Python API with the settings it names as the running command's options
    (``num_sequences must be ≥ 1`` → ``--num-sequences must be ≥ 1``): the user typed the options."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return text
    for param in ctx.command.params:
        long = [o for o in param.opts if o.startswith("--")]
        if isinstance(param, click.Option) and long and param.name:
            # a word of its own: at the start or after a space or "(", never inside a path or a value; a name
            # of several words (num_sequences) wherever it stands so, a one-word name (lr) before what is
            # said of it
            after = (r"(?![\w/.=-])" if "_" in param.name else
                     r"(?= must| ≥| >| exceeds| has no effect"
                     r"| [-0-9.]+ (?:must|exceeds|there|has no effect))")
            text = re.sub(rf"(?<![^\s(]){re.escape(param.name)}{after}", long[0], text)
    return text


class _OptionNames(logging.Filter):
    """Warnings the API logs name its settings; the command's user typed options (:func:`_as_options`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and record.name.startswith("stiefkv"):  # ours only
            try:
                record.msg, record.args = _as_options(record.getMessage()), None
            except Exception:  # a record that cannot be formatted is logging's to report, not ours to raise
                pass
        return True


def require_matplotlib() -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or stiefkv[plot])")


def _check_plot_format(path: Path) -> None:
    """Refuse a --plot name whose format matplotlib cannot write, before the work it would be drawn from."""
    from matplotlib.figure import Figure

    kinds = Figure().canvas.get_supported_filetypes()
    kind = path.suffix[1:].lower() or "png"
    if kind not in kinds:
        raise ValueError(f"--plot {path}: matplotlib cannot write .{kind} files; name a file ending in "
                         f"{', '.join('.' + k for k in sorted(kinds))}")


def _setup(device: str, dtype: str, seed: int, debug: bool):
    """Logging, the seed, and the resolved ``(device, dtype)``; a bad ``--device`` is a one-line error."""
    import torch

    _logging(debug)
    dev = _device(device)
    if not 0 <= seed <= SEED_MAX:  # per-layer seeds (seed·100003 + layer) and torch's take int64
        raise UserError(f"--seed must be in 0 … {SEED_MAX}, got {seed}")
    torch.manual_seed(seed)
    return str(dev), getattr(torch, DTYPES[dtype])


def _device(device: str):
    """``resolve_device``, its refusal a one-line error naming ``--device``."""
    from stiefkv.models import resolve_device

    try:
        return resolve_device(device)
    except ValueError as exc:
        raise UserError(f"--device {device}: {exc}") from None


def _logging(debug: bool) -> None:
    level = logging.DEBUG if debug else logging.INFO
    if int(os.environ.get("RANK", "0")) != 0:  # one of several processes (torchrun): rank 0 reports progress
        level = logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _OptionNames) for f in handler.filters):
            handler.addFilter(_OptionNames())
    for noisy in ("transformers", "accelerate", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _output_file(ctx, param, value):
    """An option naming a file to write, as a ``Path``; a name ending in a path separator is refused here,
    while the separator is still there (``Path("name/")`` is ``name``: the file ``name`` would be written
    where the user meant a folder)."""
    if value is None or value == "-":
        return value if value is None else Path(value)
    value = os.path.expanduser(value)  # the shell leaves ~ alone after "=" (--output=~/x): one path for all
    if value.endswith(("/", os.sep)) or Path(value).name in ("", ".", ".."):
        example = Path(value) / OUTPUT_EXAMPLES.get(param.name, "out")
        raise UserError(f"{'/'.join(param.opts)} {value!r} names a folder, not the file to write: give a "
                        f"file name, e.g. {str(example)!r}")
    return Path(value)


OUTPUT_EXAMPLES = {"output": "smollm2-50.safetensors", "plot": "profiles.png", "json_path": "results.json"}


def _check_outputs(outputs: dict, model: str, files: tuple = (), data: str | None = None) -> None:
    """Refuse an output that is one of the inputs, lies inside a model folder being read, is a data file
    inside a data folder being read, or is another output; then check that each can be written (its
    missing folders are made when it is written). Paths are compared resolved (symlinks followed) and by
    inode where both exist.

    ``outputs`` maps an option name to a path (None: not given); ``files`` are input files or folders.
    """
    from stiefkv.models import cache_dir, is_gguf, model_paths
    from stiefkv.projections import ensure_writable

    inputs = [("the model", p) for p in model_paths(model)] + [("an input", Path(f)) for f in files if f]
    if is_gguf(model):
        inputs.append(("the de-quantised model cache", cache_dir() / "gguf"))
    data_path = Path(data).expanduser() if data not in (None, "wikitext2", "self") else None
    if data_path is not None and data_path.exists():
        inputs.append(("the --data", data_path))
    if data == "wikitext2":  # the local WikiText-2 files it reads (no other file of those folders)
        from stiefkv.data import WIKITEXT_FILES, data_dirs

        inputs += [("a WikiText-2 file", root / "wikitext-2" / name) for _, root in data_dirs()
                   for name in WIKITEXT_FILES.values() if (root / "wikitext-2" / name).is_file()]
    seen = {}
    for name, path in outputs.items():
        if path is None:
            continue
        resolved = path.expanduser().resolve()
        for other, other_path in seen.items():
            if resolved == other_path:
                raise UserError(f"{name} and {other} are the same file {path}: give them different paths")
        for what, src in inputs:
            src_resolved = src.expanduser().resolve()
            same = resolved == src_resolved or (
                resolved.exists() and src_resolved.is_file() and os.path.samefile(resolved, src_resolved))
            if same:
                raise UserError(f"{name} {path} is {what} ({src}), which this command reads: writing there "
                                "would destroy it; choose another output path")
            if src_resolved.is_dir() and resolved.is_relative_to(src_resolved):
                if what == "the --data" and resolved.suffix not in (".txt", ".jsonl"):
                    continue  # a data folder is read for .txt/.jsonl files only
                raise UserError(f"{name} {path} lies inside {what} folder {src}, which this command reads: "
                                "choose a path outside it")
        seen[name] = resolved
    for name, path in outputs.items():
        if path is not None:
            ensure_writable(path, name)


def _write_json(path: Path, obj) -> None:
    """Write ``obj`` to ``path``, making its folders (checked writable before the work, made only now); a
    failed write leaves the file that was there."""
    from stiefkv.projections import write_atomically

    text = json.dumps(obj, indent=2)
    write_atomically(path, lambda tmp: tmp.write_text(text), "--json")


def common_options(fn):
    for option in reversed([
        click.option("--device", default="auto", show_default=True,
                     help="Where the model runs: auto (CUDA when present, else the CPU), cpu, cuda, cuda:1…"),
        click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True,
                     help="Precision of the model's weights and activations."),
        click.option("--seed", type=int, default=DEFAULTS["seed"], show_default=True,
                     help="Seed for data sampling and every random step."),
        click.option("--debug", is_flag=True, help="Show full tracebacks and debug logs."),
    ]):
        fn = option(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="stiefkv")
def main():
    """StiefKV: compress a causal LM's KV cache with learned low-rank key and value bases.

    \b
    stiefkv calibrate smollm2 --budget 0.5 -o smollm2-50.safetensors
    stiefkv inspect smollm2-50.safetensors
    stiefkv eval smollm2 --projections smollm2-50.safetensors
    """


@main.command()
@click.argument("model")
@click.option("--budget", type=float, default=DEFAULTS["budget"], show_default=True,
              help="KV-cache bytes per token as a fraction of the uncompressed bf16 cache's, in (0, 1], "
                   "latents, scales and exact tokens counted; positions (4 bytes a token) too with codes, "
                   "on top with --bits 16 (so that 1 is the full-rank cache); 0.5 halves it.")
@click.option("--bits", default=DEFAULTS["bits"], show_default=True,
              help=f"How latents are stored: {', '.join(BITS_CHOICES)}. auto = rank, bit width and group "
                   "layout chosen together per layer for keys and values (bf16 and full rank included); "
                   "16 = bf16 latents, ranks only; 8/4/3/2 = that width everywhere.")
@click.option("--recent", type=click.IntRange(min=0), default=DEFAULTS["recent"],
              help="The newest tokens every quantized latent keeps exact (as KIVI does); their bytes count "
                   f"against the budget.  [default: {DEFAULT_RECENT}, and {SMALL_BUDGET_RECENT} below a "
                   f"budget of {SMALL_BUDGET:g}]")
@click.option("--log8/--no-log8", default=DEFAULTS["log8"], show_default=True,
              help="Offer per-token codes on one 8-bit power-of-two scale per group (symmetric, 1 byte a "
                   "group instead of 4) beside the float16 scale and low.")
@click.option("--window8/--no-window8", default=DEFAULTS["window8"], show_default=True,
              help="Hold the exact recent tokens (and a channel group still filling) as int8 codes instead "
                   "of bf16; the bytes saved buy ranks and bits.")
@click.option("--kernel-storage", is_flag=True, default=DEFAULTS["kernel_storage"],
              help="Choose only storages the fused decode kernel reads in place (2-8 bits per token, no "
                   "exact window; bf16 too with --bits auto): the fastest serving, at some quality per "
                   "byte.")
@click.option("--share-heads", is_flag=True, default=DEFAULTS["share_heads"],
              help="One basis a layer for all its KV heads (one latent a token) instead of one a head, at "
                   "the same bytes: far better quality (SmolLM2 50 %, ranks only: +14 % PPL against +50 %). "
                   "Compaction keeps one entry set a layer. Slower decode where a layer has many KV heads "
                   "(Llama-3-8B's 8: 2.1-4.4x the kernel time).")
@click.option("--method", type=click.Choice(METHODS), default=DEFAULTS["method"], show_default=True,
              help="stiefel = PCA start refined on the Stiefel manifold against the decoder-layer output; "
                   "pca = top eigenvectors of the keys' and values' second moments (fast baseline).")
@click.option("--key-mode", type=click.Choice(CALIBRATION_KEY_MODES), default=DEFAULTS["key_mode"],
              show_default=True,
              help="Compress keys before RoPE (better quality where ranks are cut) or after it (faster "
                   "decode: 0.89x against 0.66x the uncompressed cache's tokens/s for full-rank int8 at "
                   "8x16k; SmolLM2 PPL within 0.1 % at 50 and 25 %, far worse below); auto = per layer: "
                   "post_rope where the allocation keeps the layer's keys at full rank, pre_rope where it "
                   "cuts them.")
@click.option("--allocation", type=click.Choice(ALLOCATIONS), default=DEFAULTS["allocation"],
              show_default=True,
              help="dp = per-layer ranks minimising the summed profiled error under the budget (exact "
                   "knapsack); uniform = the same rank in every layer: bf16 latents, or with --bits 8/4/3/2 "
                   "that width in per-token groups at the largest rank the budget holds.")
@click.option("--weighting", type=click.Choice(WEIGHTINGS), default=DEFAULTS["weighting"], show_default=True,
              help="For dp: what a layer's compression costs: the whole model's next-token KL with only "
                   "that layer compressed (kl), or the layer's own error relative to its output (output) or "
                   "to its update (update). kl runs the model's tail once a rank and layer: most of a CPU "
                   "calibration's time (a quick trial: --weighting output --rank-step 16).")
@click.option("--profile", type=click.Choice(PROFILES), default=DEFAULTS["profile"], show_default=True,
              help="For dp: profile errors with PCA bases (cheap) or refined bases at every rank (slow; "
                   "with --weighting output or update: the default kl profiles with PCA bases only).")
@click.option("--order", type=click.Choice(ORDERS), default=DEFAULTS["order"], show_default=True,
              help="sequential = each layer is fitted on the outputs of the already-compressed layers before "
                   "it; independent = on the uncompressed model's activations.")
@click.option("--steps", type=int, default=DEFAULTS["steps"], show_default=True,
              help="Riemannian Adam steps per layer (stiefel); early stopping on a held-out slice may end "
                   "sooner.")
@click.option("--lr", type=float, default=DEFAULTS["lr"], show_default=True, help="Learning rate (stiefel).")
@click.option("--loss", type=click.Choice(LOSSES), default=DEFAULTS["loss"], show_default=True,
              help="Refinement loss: the layer-output error, or that plus --kl-weight × the KL divergence "
                   "between the original and the compressed attention rows (StreamKL).")
@click.option("--kl-weight", type=float, default=DEFAULTS["kl_weight"], show_default=True,
              help="Weight of the attention KL with --loss output+kl.")
@click.option("--step-sequences", type=int, default=None,
              help="Calibration sequences per optimisation step (stiefel) "
                   f"[default: {DEFAULTS['step_sequences']}; on a CPU {CPU_SIZES['step_sequences']}]")
@click.option("--profile-sequences", type=int, default=None,
              help="Calibration sequences the error-rank profiles use (dp; the kl profile at most 4) "
                   f"[default: {DEFAULTS['profile_sequences']}; on a CPU {CPU_SIZES['profile_sequences']}]")
@click.option("--data", default=DEFAULTS["data"], show_default=True,
              help="Calibration text: wikitext2 (validation split), a .txt/.jsonl file or folder, or self "
                   "(sampled from the model: no data needed).")
@click.option("--num-sequences", type=int, default=None,
              help="Number of calibration sequences "
                   f"[default: {DEFAULTS['num_sequences']}; on a CPU {CPU_SIZES['num_sequences']}]")
@click.option("--seq-len", type=int, default=DEFAULTS["seq_len"], show_default=True,
              help="Tokens per calibration sequence. Codes are measured only on tokens past the --recent "
                   f"exact ones, and per-channel codes in whole groups of {GROUP}: below --recent + {GROUP} "
                   f"({DEFAULT_RECENT + GROUP} with {DEFAULT_RECENT} exact tokens) the channel layout is "
                   "left out of the --bits choices, with a warning.")
@click.option("--batch-size", type=int, default=DEFAULTS["batch_size"], show_default=True,
              help="Sequences per forward pass (memory vs speed).")
@click.option("--rank-step", type=int, default=DEFAULTS["rank_step"], show_default=True,
              help="Ranks are multiples of this.")
@click.option("-o", "--output", type=click.Path(), callback=_output_file, required=True,
              help="Where to write the checkpoint (.safetensors). Progress is kept in OUTPUT.partial.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from OUTPUT.partial.")
@click.option("--plot", type=click.Path(), callback=_output_file, default=None,
              help="Draw the error-rank profiles with the chosen ranks marked to this .png (needs "
                   "matplotlib).")
@common_options
def calibrate(model, output, resume, plot, device, dtype, seed, debug, **settings):
    """Learn key/value bases for MODEL and write a projection checkpoint.

    MODEL is 'smollm2', a .gguf file, a local model folder or a Hugging Face id. A list of devices
    (--device cuda:0,cuda:1) spreads a model too large for one of them over all, layer by layer.
    """
    import stiefkv
    from stiefkv.calibrate import distributed

    devices = device.split(",") if "," in device else None  # place_layers checks each
    device, torch_dtype = _setup(devices[0] if devices else device, dtype, seed, debug)
    # the options given only: the rest are CalibrationConfig's own defaults (unset sizes: the device's), and
    # a setting passed on is "given" to the warnings about settings that do nothing
    source = click.get_current_context().get_parameter_source
    settings = {k: v for k, v in settings.items()
                if v is not None and source(k) is not click.core.ParameterSource.DEFAULT}
    partial = output.with_name(output.name + ".partial")
    leader = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 writes and reports

    def work():
        if distributed.launched():
            distributed.interrupt_on_stop()  # torchrun's SIGTERM on Ctrl-C: "interrupted", --resume hint
        cfg = CalibrationConfig.from_kwargs(seed=seed, **settings)  # bad settings fail before the model loads
        check_data(cfg.data, "calibration")
        for each in devices or ():
            _device(each)  # every device of the list, before the model loads (place_layers uses them)
        if plot is not None:
            require_matplotlib()
            if cfg.allocation != "dp":
                raise ValueError("--plot draws the error-rank profiles, which only --allocation dp makes: "
                                 "drop --plot or use --allocation dp")
        if resume and not partial.exists() and output.is_file():  # it would calibrate anew over it
            raise ValueError(f"--resume: there is nothing to resume ({partial.name} does not exist), and "
                             f"{output} holds a finished run's checkpoint: drop --resume to calibrate again "
                             "over it, or give another -o")
        if leader:
            _check_outputs({"-o": output, "the progress file": partial, "--plot": plot}, model,
                           data=str(cfg.data))  # the default (wikitext2) too: its files are inputs
        if plot is not None:
            _check_plot_format(plot)
        if devices and distributed.launched():
            raise ValueError(f"--device {','.join(devices)} places one model over several devices in one "
                             "process; under torchrun give each process one device")
        dev = distributed.init_from_env(device) if not devices else "cpu"
        from stiefkv.models import saved_projections

        if saved_projections(model) is not None:
            log.info("%s holds the bases a served model saved: calibrating the original model", model)
        m, tok = stiefkv.load_model(model, device=dev, dtype=torch_dtype, projections=False)
        if devices:
            stiefkv.place_layers(m, devices)
        proj = stiefkv.calibrate(m, tok, seed=seed, progress=partial, resume=resume, **settings)
        distributed.wait_for_all()
        if not leader:
            return proj
        proj.save(output)
        partial.unlink(missing_ok=True)
        if plot is not None:
            from stiefkv.plot import plot_profiles

            plot_profiles(proj, plot)
        return proj

    found = partial.stat().st_mtime_ns if partial.is_file() else None

    def kept(text: str):  # a progress file this run wrote (one from another run may hold other settings)
        if not leader or not partial.is_file() or str(partial) in text or partial.stat().st_mtime_ns == found:
            return ""
        return f"; the progress so far is kept in {partial}: rerun with --resume to continue, or delete it"

    try:
        proj = _run(work, debug, hint=kept)
    except click.ClickException as exc:  # launched: shown here, then out without gloo's teardown
        if distributed.launched():
            exc.show()
            distributed.leave(exc.exit_code)
        raise
    if leader:
        click.echo(proj.summary())
        click.echo(f"\nwrote {output} ({proj.settings['seconds']} s)")
    distributed.leave()


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the checkpoint's header as JSON.")
def inspect(checkpoint, as_json):
    """Show a checkpoint's settings, ranks and per-layer errors."""
    from stiefkv.projections import Projections

    _logging(False)
    proj, stored = _run(lambda: Projections.load_with_header(checkpoint), False)
    click.echo(json.dumps(stored, indent=2) if as_json else proj.summary())


@main.command(name="eval")
@click.argument("model")
@click.option("--projections", type=click.Path(path_type=Path), default=None,
              help="A checkpoint to evaluate against the uncompressed model; without it, only the original.")
@click.option("--baseline", default=None,
              help="Instead of --projections, a quantization-only cache on the same harness and bytes "
                   "accounting: int8/int4/int3/int2 (keys and values per token) or kivi8/kivi4/kivi3/kivi2 "
                   f"(keys per channel over 64-token groups, values per token), each keeping its "
                   f"{DEFAULT_RECENT} newest tokens exact (add -r0 for none: kivi2-r0; -w8 to hold them in "
                   "int8: kivi2-w8); below 8 bits -mse or -vmse fit the codes by least squares (all, or the "
                   "values only: int4-mse); or transformers' own QuantizedCache (optimum-quanto backend): "
                   "hf-quanto4/hf-quanto2, scored 64 tokens per forward through the cache.")
@click.option("--data", default="wikitext2", show_default=True,
              help="Test text: wikitext2 (test split) or a .txt/.jsonl file or folder.")
@click.option("--window", type=int, default=2048, show_default=True, help="Tokens per perplexity window.")
@click.option("--windows", type=int, default=None, help="Score only the first N windows (default: all).")
@click.option("--batch-size", type=int, default=1, show_default=True, help="Windows per forward pass.")
@click.option("--backend", type=click.Choice(["auto", "triton", "reference"]), default="reference",
              show_default=True,
              help="Attention over latents: the PyTorch reference (SDPA's fused causal path; fastest for "
                   "these whole-window prefills), Triton kernels (CUDA), or auto (Triton on CUDA).")
@click.option("--attention-kl", is_flag=True,
              help="Also report each layer's attention KL between the original and compressed attention at a "
                   "long context (StreamKL on CUDA; memory linear in the context).")
@click.option("--kl-context", type=int, default=8192, show_default=True, help="Tokens for --attention-kl.")
@click.option("--compact", type=float, default=None,
              help="Compressed-context perplexity instead: prefill --context tokens, compact their cache to "
                   "this fraction per KV head (--compact-method), score the next 511 tokens on top (a chunk "
                   "of 512 after the context: its first is predicted by the context's last), against the "
                   "same chunks uncompressed (the uncompressed model's own cache; --windows = chunks).")
@click.option("--context", type=int, default=4096, show_default=True, help="Context tokens for --compact.")
@click.option("--passkey", type=int, default=None, metavar="N",
              help="With --compact: pass-key retrieval instead of perplexity, over N prompts of --context "
                   "tokens drawn from --seed (filler with a five-digit key at a random depth), answered "
                   "after the compacted context and after the whole one.")
@click.option("--compact-method", type=click.Choice(COMPACT_METHODS),
              default="am", show_default=True,
              help="am = attention matching (keys, β and values fitted); attention evicts all but the keys "
                   "the same reference queries attend to most; the others are kvpress's presses, scored as "
                   "kvpress defines them (stiefkv/presses.py; snapkv = SnapKVPress, …). --compact is the "
                   "share kept (kvpress's compression_ratio is the share removed); snapkv always keeps its "
                   "64-token window, so below 64 kept tokens it is recency.")
@click.option("--pin", type=float, default=None,
              help="With --compact (am, attention): the share of the kept entries that hold the prompt's "
                   "most surprising tokens exact, in [0, 1); 0 for none. Default: am a tenth (at least 64 "
                   "tokens, at most a quarter; none below 128 kept entries), attention none.")
@click.option("--json", "json_path", type=click.Path(), callback=_output_file, default=None,
              help="Also write the results as JSON to this file; '-' prints the JSON instead of the table.")
@common_options
def evaluate(model, projections, baseline, data, window, windows, batch_size, backend, attention_kl,
             kl_context, compact, context, passkey, compact_method, pin, json_path, device, dtype, seed,
             debug):
    """WikiText-2 perplexity, layer error, next-token KL and KV bytes per token of MODEL (or, with
    --compact, the perplexity after a compacted context)."""
    import stiefkv
    from stiefkv.evaluate import attention_kl_per_layer, format_table, kl_tokens
    from stiefkv.evaluate import evaluate as run_eval
    from stiefkv.models import check_context

    device, torch_dtype = _setup(device, dtype, seed, debug)
    if backend == "triton" and not device.startswith("cuda"):
        raise UserError(f"--backend triton runs the Triton kernels on CUDA, and the device is {device}: use "
                        "--backend reference (or auto)")
    for name, value, least in (("--window", window, 2), ("--windows", windows, 1),
                               ("--batch-size", batch_size, 1), ("--kl-context", kl_context, 2)):
        if value is not None and value < least:
            raise UserError(f"{name} must be ≥ {least}, got {value}")
    from stiefkv.evaluate import BASELINES, TRANSFORMERS_BASELINES

    if baseline is not None and baseline not in BASELINES | TRANSFORMERS_BASELINES:
        raise UserError(f"--baseline {baseline}: choose one of "
                        f"{', '.join([*BASELINES, *TRANSFORMERS_BASELINES])}")
    if baseline is not None and projections is not None:
        raise UserError("give --projections or --baseline, not both")
    if baseline in TRANSFORMERS_BASELINES:
        typed = click.get_current_context().get_parameter_source
        for name in ("batch_size", "backend"):
            if typed(name) is not click.core.ParameterSource.DEFAULT:
                log.warning("--%s has no effect with --baseline %s (one window at a time through "
                            "transformers' own attention)", name.replace("_", "-"), baseline)
    if attention_kl and projections is None:
        raise UserError("--attention-kl compares with compressed attention: give --projections")
    if compact is not None:
        if not 0 < compact <= 1:
            raise UserError(f"--compact must be in (0, 1] (the fraction of context tokens kept), got "
                            f"{compact}")
        if baseline is not None or attention_kl:
            raise UserError("--compact compacts the uncompressed model's cache, or with --projections the "
                            "served model's latent cache: drop --baseline and --attention-kl")
        from stiefkv.compaction import METHODS as AM_METHODS

        if projections is not None and (passkey is not None or compact_method not in AM_METHODS):
            fix = ("drop --passkey" if passkey is not None else
                   f"use --compact-method am or attention (not {compact_method})")
            raise UserError("--compact with --projections measures perplexity with --compact-method am or "
                            "attention (pass-key retrieval and kvpress's presses run on the uncompressed "
                            f"model): {fix}, or drop --projections")
        if context < 2:
            raise UserError(f"--context must be ≥ 2, got {context}")
        source = click.get_current_context().get_parameter_source
        idle = ["window", "batch_size", "backend"] + (["data", "windows"] if passkey is not None else [])
        for name in idle:
            if source(name) is not click.core.ParameterSource.DEFAULT:
                log.warning("--%s has no effect with --compact%s (%s)", name.replace("_", "-"),
                            " --passkey" if passkey is not None else "",
                            "AM's reference queries are its own window of 1024" if name == "window"
                            else "the prompts are generated" if name in ("data", "windows")
                            else "one chunk a forward, on the default backend")
    if pin is not None and (compact is None or compact_method not in ("am", "attention") or not 0 <= pin < 1):
        raise UserError(f"--pin is the share of the kept entries held exact, with --compact and "
                        f"--compact-method am or attention, in [0, 1); got --pin {pin} (--compact {compact}, "
                        f"--compact-method {compact_method})")
    if passkey is not None and passkey < 1:
        raise UserError(f"--passkey N is the number of pass-key prompts: N ≥ 1, got {passkey}")
    if passkey is not None and compact is None:
        raise UserError("--passkey N measures retrieval after a compacted context: give --compact too (got "
                        f"--passkey {passkey} alone)")
    to_stdout = json_path is not None and str(json_path) == "-"

    def measure():
        _check_outputs({"--json": None if to_stdout else json_path}, model, files=(projections,), data=data)
        if passkey is None:  # the pass-key prompts are generated, not read
            check_data(data, "test")
        from stiefkv.evaluate import (
            baseline_projections,
            evaluate_through_cache,
            require_quanto,
            transformers_quantized_cache,
        )

        proj = stiefkv.Projections.load(projections) if projections else None
        if baseline in TRANSFORMERS_BASELINES:
            require_quanto(baseline)  # before the model loads
        from stiefkv.models import UNNAMED, model_paths, served_bases, unnamed_projections

        local = bool(model_paths(model))
        left = unnamed_projections(model)
        if left is not None and proj is None and baseline is None:
            log.warning("%s is not evaluated: %s. To evaluate it: --projections %s", left, UNNAMED, left)

        def own_bases(config=None):  # a hub id's only once its config is read (no second lookup)
            saved = served_bases(model, config)
            if saved is not None and proj is None and baseline is None:
                if passkey is not None:
                    raise ValueError(f"{model} holds the bases a served model saved (in {saved.name}), "
                                     "and --passkey measures the uncompressed model only: give the original "
                                     "model")
                log.info("%s holds the bases it was served with: evaluating them against the original", model)
                return saved, stiefkv.Projections.load(saved)
            return saved, proj

        saved, proj = own_bases() if local else (None, proj)
        # the original model: a folder a served model saved is evaluated against itself uncompressed
        m, tok = stiefkv.load_model(model, device=device, dtype=torch_dtype, projections=False)
        if not local:
            saved, proj = own_bases(m.config)
        if compact is not None:
            from stiefkv.longcontext import evaluate_compacted, evaluate_retrieval

            pinned = {} if pin is None else {"pin": pin}
            if passkey is not None:
                return evaluate_retrieval(m, tok, context=context, keep=compact, method=compact_method,
                                          samples=passkey, seed=seed, **pinned)
            # the file, not the loaded bases: the result names the checkpoint by its path
            source = projections or (saved if proj is not None else None)
            return evaluate_compacted(m, tok, context=context, keep=compact, method=compact_method,
                                      chunks=windows, data=data, projections=source, **pinned)
        check_context(m.config, window, "--window")
        if baseline in TRANSFORMERS_BASELINES:
            return evaluate_through_cache(m, tok, lambda: transformers_quantized_cache(m, baseline),
                                          name=baseline, data=data, window=window, limit=windows,
                                          model_name=model)
        if baseline is not None:
            proj = baseline_projections(m, baseline, context=window)  # its bytes where they are scored
        kl_stream = None
        if attention_kl:
            check_context(m.config, kl_context, "--kl-context")
            kl_stream = kl_tokens(tok, data, kl_context)
        result = run_eval(m, tok, proj, data=data, window=window, limit=windows, batch_size=batch_size,
                          backend=backend, model_name=model)
        if attention_kl:
            result.attention_kl_context = kl_context
            result.attention_kl = attention_kl_per_layer(m, tok, proj, data=data, context=kl_context,
                                                         stream=kl_stream)
        return result

    def work():  # every kind of evaluation writes its --json file the same way
        result = measure()
        if json_path is not None and not to_stdout:
            _write_json(json_path, result.as_dict())
        return result

    result = _run(work, debug)
    if to_stdout:
        click.echo(json.dumps(result.as_dict(), indent=2))
        return
    if compact is not None:
        from stiefkv.longcontext import format_compacted, format_retrieval

        click.echo(format_retrieval(result) if passkey is not None else format_compacted(result))
    else:
        click.echo(format_table(result))
    if json_path is not None:
        click.echo(f"\nwrote {json_path}")


if __name__ == "__main__":
    sys.exit(main())
