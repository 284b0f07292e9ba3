"""The engine study's claim (5): R3 against R2 on rollouts from a real inference engine, a `PairedClaim`
declaration, with the measured engine/trainer gap as its note."""

from __future__ import annotations

from pathlib import Path

from moe_rl.analysis.claims.cells import (
    load_experiment,
    low_precision_large_n,
)
from moe_rl.analysis.claims.paired import COLLAPSE_OUTCOMES, AlsoOn, PairedClaim
from moe_rl.analysis.claims.rules import (
    ACCURACY_DEFINITION,
    ACCURACY_MARGIN,
    COLLAPSE_MARGIN,
    INCONCLUSIVE,
    UNTESTABLE_HERE,
)
from moe_rl.metrics.names import (
    FLIP_RATE,
    ROLLOUT_LOGP_GAP,
    ROLLOUT_LOGP_GAP_OVER_LN2,
    ROLLOUT_TOKEN_MULT_PROB_ERROR,
    ROLLOUT_VS_OLD,
    TOKEN_FLIP_RATE,
    route_key,
)

# claim 5's measured gap, a note beside its verdict

R3_PAPER_GAP = "~10% of routers and 94% of tokens route differently between inference and training (Qwen3-30B-A3B)"
ENGINE_GAP_KEYS = (
    ROLLOUT_LOGP_GAP,
    ROLLOUT_TOKEN_MULT_PROB_ERROR,
    ROLLOUT_LOGP_GAP_OVER_LN2,
    route_key(ROLLOUT_VS_OLD, FLIP_RATE),
    route_key(ROLLOUT_VS_OLD, TOKEN_FLIP_RATE),
)


def engine_gap(root: Path) -> list[str]:
    """Mean engine/trainer gap over all steps and runs of engine_mismatch (per-run means, then the mean), beside
    the R3 paper's: a different scale, shown, not compared."""
    df = load_experiment(root, "engine_mismatch", list(ENGINE_GAP_KEYS))
    if df is None or df.empty:
        return []
    means = df.groupby(["run", "key"])["value"].mean().groupby("key").mean()
    parts = [f"{k.split('/', 1)[1]} {means[k]:.3g}" for k in ENGINE_GAP_KEYS if k in means]
    return [
        "measured engine (vLLM, bfloat16) vs trainer (float32) gap, mean over steps and runs: "
        + "; ".join(parts)
        + f". The R3 paper reports {R3_PAPER_GAP}: a different scale (a 30B model, long sequences), shown "
        "side by side, not compared"
    ]


R3_VS_R2 = PairedClaim(
    5,
    "With a train/inference gap and large N, R3 beats R2",
    "arXiv 2512.01374",
    "runs with rollouts from a real inference engine (vLLM in bfloat16, float32 training) and the largest N "
    "(N >= 4 where present), in the cells where grpo+r2 and grpo+r3 end below their cold start on average: "
    "grpo+r3 vs grpo+r2 on collapse (exact CMH over cells, one-sided) and final accuracy "
    f"({ACCURACY_DEFINITION}, as in claims 2 and 3; paired by seed and cell: bootstrap interval, "
    "sign-flip test), Holm over the two and Bonferroni over the looks at the data (cells added by an extension "
    "of the experiment file). reproduced if either favours R3 at Holm p < 0.05 and neither favours "
    "R2; not reproduced if either favours R2 at Holm p < 0.05, or both intervals lie within their margins "
    f"(collapse ±{COLLAPSE_MARGIN}, accuracy ±{ACCURACY_MARGIN}); inconclusive otherwise; "
    f"{UNTESTABLE_HERE} when no cell degrades. The same test "
    "on `phase_mismatch` (the gap emulated by casting the rollout model to bfloat16) is reported as a note",
    experiment="engine_mismatch",
    worse="grpo+r2",
    better="grpo+r3",
    outcomes=COLLAPSE_OUTCOMES,
    runs=low_precision_large_n,
    names={"grpo+r2": "R2", "grpo+r3": "R3"},
    cells_text="{n} cell(s): {cells}",
    also=(
        AlsoOn(
            "phase_mismatch",
            "emulated gap (`phase_mismatch`, bfloat16 cast of the rollout model): {verdict} ({reason}); "
            "{statistic}; {test}",
        ),
        AlsoOn(
            "engine_mismatch_stable",
            "the first engine cells (`engine_mismatch_stable`): {verdict} ({reason}); {statistic}",
        ),
    ),
    describe=engine_gap,
    no_arms=(INCONCLUSIVE, "no grpo+r2 and grpo+r3 runs with a low-precision engine rollout"),
)
