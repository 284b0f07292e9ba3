"""The harness's numbers do not move: a short pinned R2 run logs the metrics it logged when the digest was written.

`scripts/fingerprint.py --pinned` runs a 4-step R2 run under `numerics=avx2` (ATen, MKL and oneDNN on the
kernels every AVX2 x86 CPU runs alike, one thread) and hashes every logged value but the wall-clock keys.
A refactor that changes any number, in any metric, at any step, changes the digest. A deliberate change of
behaviour rewrites it (`--pinned --write tests/data/fingerprint_pinned.json`) in the same commit, saying why.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT

REFERENCE = ROOT / "tests" / "data" / "fingerprint_pinned.json"


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx2" in f.read().split()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx2(), reason="the pinned kernels need an AVX2 x86 CPU")
def test_pinned_r2_run_is_bitwise_the_reference() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/fingerprint.py", "--pinned", "--check", str(REFERENCE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and "bitwise equal" in out.stdout, out.stdout + out.stderr[-3000:]
