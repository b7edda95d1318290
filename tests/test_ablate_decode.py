"""benchmarks/ablate_decode.py and try_decode_variants.py build their variants by editing the kernel's source:
every edit must still find its lines, or a script would time the unedited kernel under a variant's name."""

import importlib.util
import pathlib

import pytest

pytest.importorskip("triton")

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["ablate_decode", "try_decode_variants"])
def test_every_variant_applies_to_the_kernel_in_the_tree(script, tmp_path):
    ablate = _load("ablate_decode")
    variants = _load(script).VARIANTS
    source = ablate.SRC.read_text()
    for name, edits in variants.items():
        module = ablate.build(name, edits, tmp_path)
        assert callable(module.lowrank_attention), name
        variant_source = pathlib.Path(module.__file__).read_text()
        assert (variant_source != source.replace("from .reference import", "from stiefkv.kernels.reference import")
                ) == bool(edits), name
    with pytest.raises(SystemExit, match="no longer contains"):
        ablate.build("stale", [("no such line\n", "")], tmp_path)
