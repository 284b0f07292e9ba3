"""What the loop measures: metric names, partial statistics, ratio and route statistics, collapse, verdicts."""
