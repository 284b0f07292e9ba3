"""Shared fixtures: test isolation and the cold-start cache (plain helpers are in helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Runs with `threads=N` set torch's thread count process-wide; restore it after each test, so a
    test's float results (which depend on the kernels' thread split) do not depend on the tests before it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def _session_cold_starts(tmp_path_factory: pytest.TempPathFactory):
    """One cold-start cache folder for the whole session, in its base temporary folder, which pytest-xdist's
    workers share (each worker's own is a folder inside it): a new one each session, so every session trains each
    warm-up it needs once."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = base / "cold_start"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def cache(_session_cold_starts):
    """The cold-start cache of the tests: shared by every module and xdist worker of the session, so each warm-up
    (its key: the model, task and cold-start config that determine its weights) is trained once per session, not
    once per module and worker. A warm-up is trained under a file lock (`moe_rl.loop.cold_start.get_cold_start`):
    a process that needs it meanwhile waits, then reads it."""
    return _session_cold_starts
