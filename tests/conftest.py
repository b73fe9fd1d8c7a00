"""Shared test paths. Data in ../shared is for tests only and may be absent: tests skip then."""

from pathlib import Path

import pytest
import torch

DATA = Path(__file__).parent / "data"
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
