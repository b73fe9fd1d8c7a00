"""magrpo.speedups.heap: with freed memory kept, a re-allocated tensor costs no page faults."""

import json
import subprocess
import sys

import pytest

from magrpo.speedups import heap

pytestmark = pytest.mark.skipif(heap._LIBC is None, reason="not glibc")

# A 64 MB tensor, freed, then a 48 MB one: the page faults of the second. glibc maps an
# allocation this large on its own and unmaps it when freed, so without keep_freed_memory()
# every page of the second tensor is a fresh one.
_SCRIPT = """
import json, resource, sys
import torch
from magrpo.speedups.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
torch.ones(16 * 2**20)  # 64 MB of float32, freed at once
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = faults()
torch.ones(12 * 2**20)
print(json.dumps({"kept": kept, "faults": faults() - before}))
"""
_PAGES = 48 * 2**20 // 4096


def _faults(policy: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, policy], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_kept_memory_is_reused_without_page_faults():
    released, kept = _faults("release"), _faults("keep")
    assert kept["kept"] and not released["kept"]
    assert released["faults"] > _PAGES // 2  # a fresh mapping (the control)
    assert kept["faults"] < _PAGES // 20  # the freed pages, reused
