"""The run's life on disk and in a launch: run folders, atomic writes, identity, loggers, progress, what a launch needs of a run folder."""
