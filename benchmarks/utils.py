"""The harness every benchmark script shares: provenance, timing, random inputs at real shapes, result rows.

A script measures, then calls :func:`write_rows`, which appends one JSON object per measurement to
``benchmarks/results/NAME.jsonl`` (or to ``$STIEFKV_RESULTS_DIR/NAME.jsonl`` where that is set, as on the
device machine, whose results come back through ``$OUT``). Every row carries the provenance of the run
(:func:`provenance`: commit and dirty flag, machine, GPU, date, library versions, command line) and a
``run_id`` shared by all rows of one process, so that rows of one run can be joined. ``render.py`` builds
BENCHMARKS.md's tables from these rows.

Timers (each returns ``{"p20", "p50", "p80"}`` in the unit its name says, as ``triton.testing.do_bench``'s
quantiles do):

- :func:`graph_ms`: device time of one call, from CUDA-graph replay, so that the host's launch cost is left
  out; warm-up outside the capture; an L2 flush before every call (subtracted again) unless the caller
  knows the working set exceeds the L2 by far.
- :func:`bench_ms`: ``triton.testing.do_bench`` (eager calls: launch cost included; warm-up excluded, the
  device synchronised around the clock, L2 flushed before every call).
- :func:`host_us`: host time of back-to-back calls, and host + device time once the device is synced.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FLUSH_BYTES = 256 * 2**20  # > 4× the H200's 60 MB L2 (50 MB on an H100)
QUANTILES = (0.2, 0.5, 0.8)
# The project's default model (SmolLM2-135M-Instruct, Q4_1 GGUF): its alias, and its file's size and md5, so
# that a copy of the file under another path (the GPU runs load ``$HOME/m/model.gguf``) is the same model
DEFAULT_MODEL = "smollm2"
DEFAULT_MODEL_FILE = (98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")


# ------------------------------------------------------------------------------------------------ provenance
def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def _commit() -> tuple[str | None, bool | None, list[str]]:
    """The commit measured and whether tracked files differed from it. ``STIEFKV_COMMIT``, ``STIEFKV_DIRTY``
    (0/1) and ``STIEFKV_DIRTY_FILES`` (comma-separated), where set, win over git: the device machine gets a
    copy of the tree whose ``.git`` (if any) is not the sender's (one answered with a stale commit), so
    the sender computes them and passes them in the command."""
    if os.environ.get("STIEFKV_COMMIT"):
        files = [f for f in os.environ.get("STIEFKV_DIRTY_FILES", "").split(",") if f]
        dirty = os.environ.get("STIEFKV_DIRTY")
        return os.environ["STIEFKV_COMMIT"], (None if dirty is None else dirty == "1"), files
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    if head is None or status is None:
        return None, None, []
    files = [line[3:] for line in status.splitlines() if line.strip()]
    return head.strip(), bool(files), files[:30]


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def command_line() -> str:
    """The command that ran this process, with the script's path relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


@functools.cache
def provenance() -> dict:
    """Where and how this process measured: one dict, computed once, shared by all its rows."""
    commit, dirty, files = _commit()
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": props.name,
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "driver": _driver(),
        }
    return {
        "run_id": uuid.uuid4().hex[:12],
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "commit": commit,
        "dirty": dirty,
        "dirty_files": files,
        "machine": platform.node(),
        "cpu": f"{platform.machine()}, {os.cpu_count()} cores",
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "command": command_line(),
    }


def _driver() -> str | None:
    out = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        if _has("nvidia-smi")
        else None
    )
    return out.stdout.strip().splitlines()[0] if out and out.returncode == 0 and out.stdout.strip() else None


def _has(program: str) -> bool:
    return any((Path(p) / program).is_file() for p in os.environ.get("PATH", "").split(os.pathsep))


def header() -> str:
    """One line of provenance to print at the top of a script's log."""
    p = provenance()
    dirty = {True: " (dirty)", False: "", None: " (dirty: unknown)"}[p["dirty"]]
    return (
        f"# {device_name()}; {p['date']}; commit {p['commit'] or 'unknown'}{dirty}; python {p['python']}, "
        f"torch {p['torch']}, triton {p['triton']}, transformers {p['transformers']}; {p['command']}"
    )


# ------------------------------------------------------------------------------------------------ models
@functools.lru_cache(maxsize=None)
def model_name(spec: str) -> str:
    """The name a row records for the model ``spec`` loads: :data:`DEFAULT_MODEL` for the default model,
    by its alias or a copy of its GGUF file under any path (the same bytes: :data:`DEFAULT_MODEL_FILE`'s
    size and sha256); else ``spec`` as given."""
    from stiefkv.models import file_sha256

    if spec == DEFAULT_MODEL:
        return spec
    path = Path(spec).expanduser()
    size, sha256 = DEFAULT_MODEL_FILE
    if path.suffix.lower() == ".gguf" and path.is_file() and path.stat().st_size == size \
            and file_sha256(path) == sha256:
        return DEFAULT_MODEL
    return spec


def model_case(spec: str) -> str:
    """`` NAME`` to put in a row's case where ``spec`` is not the default model (a local path by its file or
    folder name), else nothing: the default's cases stay as they were before rows named their model."""
    name = model_name(spec)
    if name == DEFAULT_MODEL:
        return ""
    path = Path(spec).expanduser()
    return f" {path.name if path.exists() else spec}"


def load_model(spec: str, **kwargs):
    """``stiefkv.load_model(spec, **kwargs)``; a model that cannot be loaded (a mistyped name, a missing
    file: ``ModelLoadError``, whose message says what to do) exits with that one line and status 2, as the
    ``stiefkv`` command does, instead of a traceback."""
    import stiefkv
    from stiefkv.models import ModelLoadError

    try:
        return stiefkv.load_model(spec, **kwargs)
    except ModelLoadError as err:
        script = os.path.basename(sys.argv[0]) or "benchmark"
        print(f"{script}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


# ------------------------------------------------------------------------------------------------ rows
def results_dir() -> Path:
    return Path(os.environ.get("STIEFKV_RESULTS_DIR") or RESULTS)


def check_results_dir(parser: argparse.ArgumentParser | None = None) -> Path:
    """:func:`results_dir`, checked before any work: a folder, or one that can be made. A results folder that
    was a file (a mistyped ``STIEFKV_RESULTS_DIR``) failed in ``write_rows`` after the measurement, with
    ``FileExistsError``. ``parser.error`` (else exit) with what is wrong."""
    folder = results_dir()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    problem = None
    if not existing.is_dir():
        problem = "is a file" if existing == folder else f"lies under {existing}, a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = "is not writable" if existing == folder else f"cannot be made in {existing}"
    if problem:
        message = f"rows go to {folder} ($STIEFKV_RESULTS_DIR, else benchmarks/results), which {problem}"
        if parser is not None:
            parser.error(message)
        sys.exit(message)
    return folder


def write_rows(name: str, rows: dict | Iterable[dict]) -> Path:
    """Append ``rows`` (each a dict of one measurement; ``case`` names it within the file) to ``NAME.jsonl``,
    each with ``bench`` = ``name``, ``remeasured`` (True unless the row says otherwise: False marks a
    number transcribed from an earlier document) and this process's :func:`provenance` unless the row
    brings its own. Returns the file's path."""
    rows = [rows] if isinstance(rows, dict) else list(rows)
    path = results_dir() / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            if "case" not in row:
                raise ValueError(f"a row of {name} has no 'case' (what it measured): {sorted(row)}")
            full = {"bench": name, **row}
            full.setdefault("remeasured", True)
            full.setdefault("provenance", provenance())
            f.write(json.dumps(full, default=_jsonable) + "\n")
    return path


def _jsonable(x):
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"cannot write {type(x).__name__} to a result row")


def read_rows(path: str | Path) -> list[dict]:
    """The rows of one JSONL file, in the order they were appended (later rows are newer); none where the
    file does not exist. A line that is not a JSON object (a run stopped mid-write, a hand edit) is refused
    with the file and line it is on: ``json``'s own message counted from the start of the line only."""
    text = Path(path).read_text() if Path(path).is_file() else ""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON row ({err.msg}, column {err.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: a row is a JSON object, not {type(row).__name__}")
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ timing
def quantiles(samples: list[float], qs: tuple[float, ...] = QUANTILES) -> dict:
    """``{"p20", "p50", "p80"}`` of ``samples`` (linear interpolation between order statistics)."""
    if not samples:
        raise ValueError("no samples to take quantiles of")
    xs = sorted(samples)
    out = {}
    for q in qs:
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{round(100 * q)}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


def graph_ms(fn: Callable[[], object], *, calls: int = 20, replays: int = 10, flush_l2: bool = True) -> dict:
    """Device time (ms) of one ``fn()`` from CUDA-graph replay.

    ``fn`` runs once on a side stream first (compilation, autotuning, the allocator), outside the capture.
    One graph holds ``calls`` × (L2 flush, ``fn``), another the ``calls`` flushes alone; the two are
    replayed alternately ``replays`` times and each pair's difference / ``calls`` is one sample. The flush
    writes 256 MB, so no call finds its inputs in the L2 left by the previous one; ``flush_l2=False`` only
    where the working set is several times the L2 anyway.
    """
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush_l2 else None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                if flush is not None:
                    flush.zero_()
                if with_fn:
                    fn()
        graph.replay()  # first replay: uploads the graph
        return graph

    def replay(graph: torch.cuda.CUDAGraph | None) -> float:
        if graph is None:
            return 0.0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    work = capture(True)
    base = capture(False) if flush is not None else None
    samples = [(replay(work) - replay(base)) / calls for _ in range(replays)]
    return quantiles(samples)


def bench_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> dict:
    """``triton.testing.do_bench`` p20/p50/p80 (ms) of eager calls of ``fn``: warm-up excluded, the device
    synchronised around the clock, the L2 flushed before every call."""
    from triton.testing import do_bench

    p20, p50, p80 = do_bench(fn, warmup=warmup, rep=rep, quantiles=list(QUANTILES))
    return {"p20": p20, "p50": p50, "p80": p80}


def host_us(fn: Callable[[], object], *, calls: int = 200, warmup: int = 10) -> dict:
    """Host µs per call of ``calls`` back-to-back calls, and host + device µs once the device is synced
    (the device's time shows only where it exceeds the host's)."""
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    sync()
    total = time.perf_counter() - start
    return {"host_us": host / calls * 1e6, "total_us": total / calls * 1e6}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_s(fn: Callable[[], object]) -> float:
    """Seconds of one ``fn()`` with the device synced before and after."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def copy_tbs() -> float:
    """TB/s of a 2 GiB device-to-device copy, counting bytes read and written: the bandwidth ceiling."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))["p50"]
    return 2 * src.numel() * src.element_size() / ms / 1e9


# ------------------------------------------------------------------------------------------------ inputs
def random_basis(
    G: int, d: int, r: int, *, device="cuda", dtype=torch.float32, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``[G, d, r]`` bases with orthonormal columns (QR of a Gaussian matrix, in float32, then cast)."""
    gauss = torch.randn(G, d, r, device=device, dtype=torch.float32, generator=generator)
    return torch.linalg.qr(gauss)[0].to(dtype)


def rope_spec(d: int, *, theta: float = 500000.0, scaling: float = 1.0, device="cuda"):
    """The RoPE inverse-frequency table of head dim ``d`` (Llama-3's base by default), as the kernels take
    it."""
    from stiefkv.kernels.reference import RopeSpec

    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    return RopeSpec(inv_freq, scaling)


def shape_name(B: int, N: int) -> str:
    """``4x128k`` for B = 4, N = 131072."""
    return f"{B}x{N // 1024}k" if N % 1024 == 0 else f"{B}x{N}"


# ------------------------------------------------------------------------------- calibration benchmarks
def add_llama_shape_args(ap) -> None:
    """``--layers … --seq-len``: a random Llama's shapes (Llama-3-8B's by default) and its calibration set."""
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--sequences", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)


def random_llama(args, device, dtype: torch.dtype):
    """A Llama of ``args``' shapes (:func:`add_llama_shape_args`), random weights (seed 0), on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def require_cuda(hint: str = "") -> None:
    """Exit with one line, before any work, where this benchmark cannot run: it times CUDA kernels, and
    on a CPU it failed deep inside torch (``Torch not compiled with CUDA enabled``)."""
    if not torch.cuda.is_available():
        script = os.path.basename(sys.argv[0]) or "this benchmark"
        sys.exit(f"{script} times CUDA kernels and this machine has no CUDA device"
                 + (f"; {hint}" if hint else "") + " (the tests check the kernels on a CPU: scripts/test.sh)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every option's default, options without a help text too; nothing where the help
    says its default already or there is none to say (``None``, a flag's ``False``, an empty text or list)."""

    def _format_action(self, action):
        if not action.help and _has_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = (action.help or "").strip()
        if "default" in text or not _has_default(action):
            return text
        return f"{text} (default: %(default)s)".strip()


def _has_default(action) -> bool:
    default = action.default
    none = default is None or default is False or default is argparse.SUPPRESS or default in ("", [], ())
    return not none and (bool(action.option_strings) or action.nargs in ("?", "*"))


def parser(description: str, **kwargs) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` whose ``--help`` shows every option's default (:class:`HelpFormatter`)."""
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter, **kwargs)


def at_least(low: int):
    """An argparse type: an integer ``≥ low``, refused as the arguments are parsed (before any model is
    built or any case runs)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value
    return parse


def share(text: str) -> float:
    """An argparse type: a number in (0, 1] (a budget, a keep), refused as the arguments are parsed."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value:g} is not in (0, 1]")
    return value


def comma_list(item, allowed=None):
    """An argparse type: a comma-separated list, each entry parsed by ``item`` (an argparse type, or
    ``str``) and, where ``allowed`` is given, one of it; refused whole as the arguments are parsed, so a
    typo in the last entry no longer waits for the entries before it."""
    def parse(text: str) -> list:
        values = [item(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: an empty list")
        wrong = [v for v in values if allowed is not None and v not in allowed]
        if wrong:
            raise argparse.ArgumentTypeError(f"{', '.join(map(str, wrong))}: choose among "
                                             f"{', '.join(map(str, allowed))}")
        return values
    return parse


def calibration_json(text: str) -> dict:
    """An argparse type: ``--extra``'s JSON object of calibration settings, checked against them."""
    from stiefkv.calibrate.pipeline import CalibrationConfig

    try:
        settings = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({err.msg})") from None
    if not isinstance(settings, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object of calibration settings")
    known = {key: value for key, value in settings.items() if key != "budget"}
    try:
        CalibrationConfig.from_kwargs(**known)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return settings


def check_calibration(parser: argparse.ArgumentParser, *settings: dict) -> None:
    """Each set of calibration settings as ``CalibrationConfig`` takes it, else ``parser.error`` with what
    is wrong: run after parsing, before a model loads or any row runs."""
    from stiefkv.calibrate.pipeline import CalibrationConfig

    try:
        for one in settings:
            CalibrationConfig.from_kwargs(**one)
    except (TypeError, ValueError) as err:
        parser.error(str(err))


def batch_context(text: str) -> str:
    """An argparse type: ``BATCHxCONTEXT`` (``8x16384``) checked as the arguments are parsed, so a typo
    in the last case no longer waits for the cases before it."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BATCHxCONTEXT with positive integers, e.g. "
                                         "8x16384")
    return text


def _setting_value(text: str):
    """A setting's text as Python takes it: ``true``/``false`` a bool, an integer, a number
    (``1e-3``, ``-0.5``), else the text itself (``pca``, ``auto``)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return text


def calibration_keywords(text: str) -> dict:
    """``steps=20,lr=1e-3,method=pca,kernel_storage=true`` → keyword arguments of ``stiefkv.calibrate``
    (bools and numbers parsed), checked against the calibration settings before any model is built."""
    from stiefkv.calibrate.pipeline import CalibrationConfig

    pairs = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"--extra: {item!r} is not NAME=VALUE (settings are comma-separated, e.g. "
                             "steps=20,lr=1e-3)")
        pairs[name.strip()] = _setting_value(value.strip())
    try:
        CalibrationConfig.from_kwargs(**pairs)
    except (TypeError, ValueError) as err:
        raise SystemExit(f"--extra {text!r}: {err}") from None
    return pairs
