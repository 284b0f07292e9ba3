"""Bin edges shared by the loop's metrics and the analysis (torch-free, so analysis imports stay light)."""

# Margin bins of the flip-vs-margin calibration: the gap between the k-th and (k+1)-th router
# probability, log-spaced because fine-grained routers (E = 64-128) have gaps of 1e-4..1e-2.
MARGIN_EDGES = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, float("inf"))

# Bins of the flip-vs-margin/movement curve: x = g / sigma_l, the old router's k-th vs (k+1)-th
# logit gap over the RMS change of that gap in the update at its layer (both in logits: x is unitless).
MOVE_EDGES = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, float("inf"))
