"""pass@k: the unbiased estimator against its definition by enumeration."""

from __future__ import annotations

import itertools
from math import comb

import pytest

from moe_rl.rollout.evaluation import pass_at_k


@pytest.mark.parametrize("n, c, k", [(4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 0, 2), (6, 5, 2), (3, 3, 3)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n, c, k) -> None:
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_hand_values_and_bad_input() -> None:
    assert pass_at_k(8, 2, 1) == 0.25 and pass_at_k(8, 0, 4) == 0.0 and pass_at_k(8, 5, 4) == 1.0
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)  # large n: no overflow
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
