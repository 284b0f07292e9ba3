"""The torch-free toolkit for result folders: load runs, statistics, tables across seeds, collapse definitions,
phase maps, the claims' verdict engine, figures (returned, never saved), a folder's report and the results
root's pages. What one study computes lives in `moe_rl.studies`."""

from moe_rl.analysis import stats
from moe_rl.analysis.arm_vs_reference import arm_tests, format_arm_tests_markdown
from moe_rl.analysis.claims import Claim, evaluate_claims, format_claims_markdown
from moe_rl.analysis.collapse_definitions import (
    COLLAPSE_DEFINITIONS,
    MAIN_DEFINITION,
    collapse_definitions_markdown,
    collapse_events,
)
from moe_rl.analysis.load import load_events, load_results, metric_keys, run_key_columns, runs, to_wide
from moe_rl.analysis.phase import format_phase_markdown, phase_table, phase_tests, run_outcomes
from moe_rl.analysis.plots import (
    plot_flip_by_position,
    plot_flip_rate,
    plot_layer_heatmap,
    plot_metric,
    plot_metric_vs_axis,
    plot_phase_difference,
    plot_phase_map,
    plot_ratio_variance,
    plot_reward_accuracy,
    plot_survival,
)
from moe_rl.analysis.tables import (
    SUMMARY_METRICS,
    format_summary_markdown,
    grouping,
    mean_ci95,
    per_run_mean,
    summarize,
    t_quantile_975,
    variant_per_run,
)

__all__ = [
    "COLLAPSE_DEFINITIONS",
    "MAIN_DEFINITION",
    "SUMMARY_METRICS",
    "Claim",
    "arm_tests",
    "collapse_definitions_markdown",
    "collapse_events",
    "evaluate_claims",
    "format_arm_tests_markdown",
    "format_claims_markdown",
    "format_phase_markdown",
    "format_summary_markdown",
    "grouping",
    "load_events",
    "load_results",
    "mean_ci95",
    "metric_keys",
    "per_run_mean",
    "phase_table",
    "phase_tests",
    "plot_flip_by_position",
    "plot_flip_rate",
    "plot_layer_heatmap",
    "plot_metric",
    "plot_metric_vs_axis",
    "plot_phase_difference",
    "plot_phase_map",
    "plot_ratio_variance",
    "plot_reward_accuracy",
    "plot_survival",
    "run_key_columns",
    "run_outcomes",
    "runs",
    "stats",
    "summarize",
    "t_quantile_975",
    "to_wide",
    "variant_per_run",
]
