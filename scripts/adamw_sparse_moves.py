"""How far AdamW's moments alone move a parameter that gets gradient on a share p of updates, per update it is used.

    python scripts/adamw_sparse_moves.py [--repeats 3] [--updates 1600]

A scalar AdamW with the harness's betas (0.9, 0.99; `moe_rl.algos.optimizers.BETAS`) and eps 1e-8, a gradient of
1 (+-30% noise) on a Bernoulli(p) share of updates and 0 on the rest; the move of an update is |m_hat / (sqrt(v_hat)
+ eps)|, averaged over the updates with gradient. Prints the move per p and the least-squares slope of log move on
log p over p >= 0.1 and p >= 0.4: the slope AdamW's moment dynamics give by themselves, to set beside the measured
expert-step slope (docs/findings.md, the 1/sqrt(p) test).
"""

from __future__ import annotations

import argparse

import numpy as np

from moe_rl.algos.optimizers import BETAS

SHARES = (0.1, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0)


def mean_move(p: float, rng: np.random.Generator, updates: int, eps: float = 1e-8) -> float:
    b1, b2 = BETAS
    m = v = 0.0
    moves = []
    for t in range(1, updates + 1):
        active = rng.random() < p
        g = (1 + 0.3 * rng.standard_normal()) if active else 0.0
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        step = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        if active:
            moves.append(abs(step))
    return float(np.mean(moves))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--updates", type=int, default=1600)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shares = np.array(SHARES)
    moves = np.array([np.mean([mean_move(p, rng, args.updates) for _ in range(args.repeats)]) for p in shares])
    for p, move in zip(shares, moves):
        print(f"p {p:4.2f}  move per active update {move:.3f}")
    for low in (0.1, 0.4):
        keep = shares >= low
        print(
            f"slope of log move on log p, p >= {low}: {np.polyfit(np.log(shares[keep]), np.log(moves[keep]), 1)[0]:+.2f}"
        )


if __name__ == "__main__":
    main()
