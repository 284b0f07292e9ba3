"""The run's life on disk and in a launch: run folders, atomic writes, identity, loggers, progress, Hydra glue."""
