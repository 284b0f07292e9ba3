"""What the loop measures: metric names, partial and ratio/route statistics, collapse, verdicts, run statuses."""
