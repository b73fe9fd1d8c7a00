"""Shared test paths. Data in ../shared is for tests only and may be absent: tests skip then."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).parent / "data"
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SHARED_COOPHUMANEVAL = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "coophumaneval" / "coophumaneval.json"
)


@pytest.fixture(scope="session")
def coophumaneval_file() -> Path:
    if not SHARED_COOPHUMANEVAL.exists():
        pytest.skip(f"CoopHumanEval test data not found at {SHARED_COOPHUMANEVAL}")
    return SHARED_COOPHUMANEVAL


@pytest.fixture
def torch_threads():
    """``torch.set_num_threads`` for one test; the count is restored after it (it is
    process-wide for the calling thread, and a trainer's ``torch_threads`` sets it too)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def benchmark_script(monkeypatch):
    """Import a script of benchmarks/ by name, as it runs there (its folder on sys.path, so
    its imports of the folder's other scripts resolve); those imports are dropped after."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    before = set(sys.modules)

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in set(sys.modules) - before:
        if str(BENCHMARKS) in (getattr(sys.modules[name], "__file__", None) or ""):
            del sys.modules[name]
