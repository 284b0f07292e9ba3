"""Shared test isolation."""

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
