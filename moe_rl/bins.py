"""Bin edges shared by the loop's metrics and the analysis (torch-free, so analysis imports stay light)."""

# Margin bins of the flip-vs-margin calibration: the gap between the k-th and (k+1)-th router
# probability, log-spaced because fine-grained routers (E = 64-128) have gaps of 1e-4..1e-2.
MARGIN_EDGES = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, float("inf"))
