import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("STIEFKV_DATA_DIR", str(ROOT.parent / "shared" / "data"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# pytest-xdist workers (scripts/test.sh runs one a core) share the cores: a thread each, not a core each
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
if not torch.cuda.is_available():
    # Triton reads this when it decorates kernels: set it before any test module imports one, so that every
    # kernel module is built for the interpreter whatever the collection order. StiefKV's own CPU paths
    # choose the PyTorch references by device and never reach the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    grad = torch.is_grad_enabled()
    yield
    # a benchmark's main() turns gradients off for its process; called by a test, and left by an error
    # (a model it cannot load), it turned them off for every later test of the worker
    torch.set_grad_enabled(grad)


@pytest.fixture
def corpus(tmp_path):
    """A .txt calibration corpus of 400 short sentences (about 13k characters)."""
    from tests.utils import corpus_text

    path = tmp_path / "calib.txt"
    path.write_text(corpus_text())
    return path
