"""The pieces the training loop (`moe_rl.train`) composes: the cold start and the process group."""
