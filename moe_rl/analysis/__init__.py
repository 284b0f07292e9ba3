"""Analysis of result folders: load runs, tables across seeds, figures (returned, never saved)."""

from moe_rl.analysis.drift import drift_per_run, fit_drift, flip_vs_margin, plot_drift_scaling, plot_flip_vs_margin
from moe_rl.analysis.load import load_events, load_results, metric_keys, run_key_columns, runs
from moe_rl.analysis.plots import (
    plot_flip_by_position,
    plot_flip_rate,
    plot_layer_heatmap,
    plot_metric,
    plot_ratio_variance,
    plot_reward_accuracy,
)
from moe_rl.analysis.tables import (
    SUMMARY_METRICS,
    format_summary_markdown,
    mean_ci95,
    per_run_mean,
    summarize,
    t_quantile_975,
)

__all__ = [
    "drift_per_run",
    "fit_drift",
    "flip_vs_margin",
    "plot_drift_scaling",
    "plot_flip_vs_margin",
    "SUMMARY_METRICS",
    "format_summary_markdown",
    "load_events",
    "load_results",
    "mean_ci95",
    "metric_keys",
    "per_run_mean",
    "plot_flip_by_position",
    "plot_flip_rate",
    "plot_layer_heatmap",
    "plot_metric",
    "plot_ratio_variance",
    "plot_reward_accuracy",
    "run_key_columns",
    "runs",
    "summarize",
    "t_quantile_975",
]
