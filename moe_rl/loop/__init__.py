"""The pieces the training loop (`moe_rl.train`) composes: the cold start, the process group, the passes, the step's metric assembly and the run keys."""
