"""A run's status: the `status` of its status.json, one constant each (pure, torch-free).

The loop (`moe_rl.train`), the run folder (`moe_rl.run.folder`), the signal verdict (`moe_rl.metrics.verdict`),
the logging backends and the analysis (`moe_rl.analysis.load`) all name a status by these constants.
"""

from __future__ import annotations

from typing import Final

RUNNING: Final = "running"  # in progress, or killed (Ctrl-C, SIGTERM, a lost peer): rerun the same command to resume
COMPLETED: Final = "completed"  # all steps ran and no collapse trigger fired
COLLAPSED: Final = "collapsed"  # all steps ran; a collapse trigger (reward drop, entropy collapse) fired on the way
DIVERGED: Final = "diverged"  # a non-finite loss, gradient or log-prob: the run stopped at that step
NO_SIGNAL: Final = "no_signal"  # all steps ran, but a stretch of them had every prompt group zero-variance (`reason`)
REWARD_FAILED: Final = "reward_failed"  # all steps ran, but the reward raised on too many completions (`reason`)
FAILED: Final = "failed"  # an exception other than divergence stopped the run (`error`; traceback in train.log)
INVALID: Final = "invalid"  # the config was rejected by validation before any work (`error` says why)
MISSING: Final = "missing"  # the analysis' status of a run folder without a readable status.json (never written)

# a run that ended for good: a relaunch skips it, and its checkpoint goes unless `keep_checkpoint`
FINISHED: Final = (COMPLETED, COLLAPSED, DIVERGED, NO_SIGNAL, REWARD_FAILED)
