"""benchmarks/ablate_decode.py builds its variants by editing the kernel's source: every edit must still
find its lines, or the script would time the unedited kernel under a variant's name."""

import importlib.util
import pathlib

import pytest

pytest.importorskip("triton")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ablate_decode.py"


def test_every_variant_applies_to_the_kernel_in_the_tree(tmp_path):
    spec = importlib.util.spec_from_file_location("ablate_decode", SCRIPT)
    ablate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablate)
    source = ablate.SRC.read_text()
    for name, edits in ablate.VARIANTS.items():
        module = ablate.build(name, edits, tmp_path)
        assert callable(module.lowrank_attention), name
        variant_source = pathlib.Path(module.__file__).read_text()
        assert (variant_source != source.replace("from .reference import", "from stiefkv.kernels.reference import")
                ) == bool(edits), name
    with pytest.raises(SystemExit, match="no longer contains"):
        ablate.build("stale", [("no such line\n", "")], tmp_path)
