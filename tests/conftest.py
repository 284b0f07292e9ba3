"""Shared fixtures: test isolation and the cold-start cache (plain helpers are in helpers.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Runs with `threads=N` set torch's thread count process-wide; restore it after each test, so a
    test's float results (which depend on the kernels' thread split) do not depend on the tests before it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    """A cold-start cache folder shared by the tests of one module (each trains its cold start once)."""
    return tmp_path_factory.mktemp("cold_start")
