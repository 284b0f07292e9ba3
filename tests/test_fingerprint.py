"""The harness's numbers do not move: a short pinned R2 run logs the metrics it logged when the digest was written.

`scripts/fingerprint.py --pinned` runs a 4-step R2 run under each pinned numerics mode (`numerics=avx2`,
`numerics=portable`: ATen, MKL and oneDNN on fixed kernel paths, one thread) and hashes every logged value
but the wall-clock keys. A refactor that changes any number, in any metric, at any step, changes the digest.
A deliberate change of behaviour rewrites the file (`--pinned --write`, on every CPU it was verified on) in
the same commit, saying why.

A pinned digest holds per CPU vendor and model (MKL chooses kernels by vendor: docs/numerics.md), so the
reference keeps one per CPU it was verified on. On a CPU it has none for, the test checks what it can: the
pinned run is bitwise equal to itself with the host told to take other kernel paths, and it says which
digests this CPU gave, to add once verified.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers import ROOT

from moe_rl.run.folder import cpu_id

REFERENCE = ROOT / "tests" / "data" / "fingerprint_pinned.json"
COMPILED = ROOT / "tests" / "data" / "fingerprint_compiled.json"  # compile=true: inductor's numerics, per CPU
# inductor compiles the compiled run's graphs for 2-5 minutes on 2 cores (a cold cache), past the suite's budget
RUN_COMPILED = os.environ.get("MOE_RL_COMPILED_FINGERPRINT") == "1"
# a host whose ATen is told to use no vector kernels, MKL its widest path and oneDNN every ISA
OTHER_PATHS = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "AUTO",
    "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    "ONEDNN_MAX_CPU_ISA": "ALL",
}


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx2" in f.read().split()
    except OSError:
        return False


def _fingerprint(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "scripts/fingerprint.py", "--pinned", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_reference_keeps_one_digest_per_verified_cpu() -> None:
    ref = json.loads(REFERENCE.read_text())
    assert set(ref) == {"r2_avx2", "r2_portable"}
    assert "GenuineIntel Intel(R) Xeon(R) Processor" in ref["r2_avx2"] and set(ref["r2_portable"]) <= set(
        ref["r2_avx2"]
    )
    # the pin is per vendor: CPUs verified under numerics=avx2 give bits of their own (docs/numerics.md)
    assert len(set(ref["r2_avx2"].values())) == len(ref["r2_avx2"])
    # ... while MKL's COMPATIBLE branch gave the same bits on every CPU verified, Intel and AMD alike (the
    # cross-vendor guarantee docs/numerics.md states; each CPU's own run is checked against it below)
    assert len(ref["r2_portable"]) >= 2 and len(set(ref["r2_portable"].values())) == 1
    assert all(len(d) == 64 for digests in ref.values() for d in digests.values())


@pytest.mark.skipif(not _has_avx2(), reason="the pinned kernels need an AVX2 x86 CPU")
def test_pinned_r2_runs_are_bitwise_this_cpus_reference(tmp_path: Path) -> None:
    known = any(cpu_id() in digests for digests in json.loads(REFERENCE.read_text()).values())
    if known:
        out = _fingerprint("--check", str(REFERENCE))
        assert out.returncode == 0 and "bitwise equal" in out.stdout, out.stdout + out.stderr[-3000:]
        return
    # not verified on this CPU: the pin must still hold against the host's own kernel choices
    mine, other = tmp_path / "mine.json", tmp_path / "other.json"
    for path, env in ((mine, None), (other, OTHER_PATHS)):
        out = _fingerprint("--write", str(path), env=env)
        assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(mine.read_text()) == json.loads(other.read_text())
    warnings.warn(
        f"no pinned reference for {cpu_id()!r}: checked only that the pin holds against the host's kernel "
        f"choices; its digests: {mine.read_text()}",
        stacklevel=1,
    )


@pytest.mark.skipif(not _has_avx2(), reason="the pinned kernels need an AVX2 x86 CPU")
def test_a_reference_for_another_cpu_only_is_reported_not_passed(tmp_path: Path) -> None:
    """--check on a file without this CPU exits 3 and names the CPUs it was verified on (never 'equal')."""
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"r2_avx2": {"SomeVendor Some CPU": "0" * 64}}))
    out = _fingerprint("--check", str(ref))
    assert out.returncode == 3 and "no reference for this CPU" in out.stdout and "SomeVendor" in out.stdout


def test_the_compiled_reference_sits_beside_the_eager_one() -> None:
    """compile=true's digests are their own file and run name: the eager digests above stay what they were."""
    ref = json.loads(COMPILED.read_text())
    assert set(ref) == {"r2_avx2_compiled"} and ref["r2_avx2_compiled"]
    assert all(len(d) == 64 for d in ref["r2_avx2_compiled"].values())
    eager = json.loads(REFERENCE.read_text())["r2_avx2"]
    assert not set(ref["r2_avx2_compiled"].values()) & set(eager.values())  # its own numerics domain


@pytest.mark.slow
@pytest.mark.skipif(not RUN_COMPILED, reason="minutes of inductor compiling: MOE_RL_COMPILED_FINGERPRINT=1 runs it")
@pytest.mark.skipif(not _has_avx2(), reason="the pinned kernels need an AVX2 x86 CPU")
def test_compiled_pinned_r2_runs_are_bitwise_this_cpus_reference(tmp_path: Path) -> None:
    """The pinned R2 run with compile=true: bitwise this CPU's compiled digest; on a CPU without one, bitwise itself
    in a second process (which reads inductor's cache the first one wrote)."""
    if any(cpu_id() in digests for digests in json.loads(COMPILED.read_text()).values()):
        out = _fingerprint("--compiled", "--check", str(COMPILED))
        assert out.returncode == 0 and "bitwise equal" in out.stdout, out.stdout + out.stderr[-3000:]
        return
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    for path in (first, second):
        out = _fingerprint("--compiled", "--write", str(path))
        assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(first.read_text()) == json.loads(second.read_text())
    warnings.warn(f"no compiled reference for {cpu_id()!r}; its digest: {first.read_text()}", stacklevel=1)
