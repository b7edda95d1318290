"""The import rules of DESIGN.md ("Data flow"), read from the source, and serving without geoopt, run."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"stiefkv": ROOT / "stiefkv", "stiefkv.calibrate": ROOT / "calibrate",
            "stiefkv.kernels": ROOT / "stiefkv" / "kernels"}
# Serving: what `import stiefkv` and `stiefkv.load` need. Evaluation shares the neutral stiefkv.layers.
SERVING = ["stiefkv", "stiefkv.attention", "stiefkv.cache", "stiefkv.layers", "stiefkv.models",
           "stiefkv.projections"]


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, anywhere in the file (lazy imports inside functions count too)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = node.module or ""
            full = f"{base}.{module}".strip(".") if node.level else module
            out.add(full)
            out.update(f"{full}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return out


def reaches(found: set[str], prefix: str) -> set[str]:
    return {m for m in found if m == prefix or m.startswith(prefix + ".")}


ALL = modules()


def test_the_table_covers_the_tree():
    assert {"stiefkv.attention", "stiefkv.cache", "stiefkv.layers", "stiefkv.evaluate", "stiefkv.cli",
            "stiefkv.calibrate.pipeline", "stiefkv.kernels.reference"} <= set(ALL)


@pytest.mark.parametrize("name", [n for n in ALL if n.startswith("stiefkv.kernels")])
def test_kernels_import_nothing_from_the_rest(name):
    outside = {m for m in reaches(imports(name, ALL[name]), "stiefkv") if not m.startswith("stiefkv.kernels")}
    assert not outside, f"{name} imports {sorted(outside)}"


@pytest.mark.parametrize("name", [n for n in ALL if n.startswith("stiefkv.calibrate")])
def test_calibration_never_imports_the_cli(name):
    assert not reaches(imports(name, ALL[name]), "stiefkv.cli"), name


@pytest.mark.parametrize("name", SERVING + ["stiefkv.evaluate"])
def test_serving_and_evaluation_never_import_calibration(name):
    found = imports(name, ALL[name])
    bad = reaches(found, "stiefkv.calibrate") | reaches(found, "geoopt")
    if name == "stiefkv":  # the package imports the light, callable calibration package itself
        bad -= {"stiefkv.calibrate"}
        bad = {m for m in bad if m != "stiefkv.calibrate.pipeline.CalibrationConfig"
               and m != "stiefkv.calibrate.pipeline"}
    assert not bad, f"{name} imports {sorted(bad)}"


def test_only_the_riemannian_optimisers_import_geoopt():
    """One module imports geoopt (``geoopt_module``, called by the Stiefel refinement and the learned
    rotation when they run); serving never needs it."""
    users = sorted(n for n, p in ALL.items() if reaches(imports(n, p), "geoopt"))
    assert users == ["stiefkv.calibrate.stiefel"]
    lazy = [n for n in ALL if "geoopt_module" in ALL[n].read_text() and n != "stiefkv.calibrate.stiefel"]
    assert lazy == ["stiefkv.calibrate.rotation"]


def test_serving_loads_and_runs_without_geoopt():
    """In a fresh interpreter where ``import geoopt`` fails: import the package, the kernels and the CLI
    (whose eval and inspect need no geoopt), load bases into a model, run a forward and generate, evaluate;
    calibration then says what is missing."""
    script = textwrap.dedent("""
        import sys
        sys.modules["geoopt"] = None  # any import of geoopt raises ImportError
        import torch
        import stiefkv, stiefkv.kernels, stiefkv.evaluate, stiefkv.cli
        from tests.tiny import random_projections, tiny_model
        assert "geoopt" not in [m for m in sys.modules if sys.modules[m] is not None]
        model = tiny_model("llama")
        stiefkv.load(model, random_projections(model, 8, 16))
        x = torch.randint(0, 97, (1, 6))
        out = model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 9)
        try:
            stiefkv.calibrate(tiny_model("llama"), None, sequences=x)  # the Stiefel refinement, by default
        except ImportError as exc:
            assert "geoopt" in str(exc), exc
        else:
            raise AssertionError("calibration ran without geoopt")
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_no_top_level_folder_shadows_an_installed_distribution():
    """A package folder at the checkout's top shadows any installed module of its name wherever Python
    starts there (``python -m pytest``): transformers 5.25 depends on Hugging Face's ``kernels``, which the
    kernels' old top-level folder hid, so loading any model failed."""
    from importlib.metadata import packages_distributions

    installed = packages_distributions()
    ours = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"]
    assert "stiefkv" in ours
    clashes = {name: installed[name] for name in ours if name in installed and name != "stiefkv"}
    assert not clashes, f"top-level folders shadow installed packages: {clashes}"
