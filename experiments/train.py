"""Hydra entry point: a thin wrapper around `moe_rl.train.train`.

    python experiments/train.py algo=gspo replay=none seed=1
    python experiments/train.py -m +preset=compare                      # the headline sweep
    python experiments/train.py -m +preset=compare hydra/launcher=joblib hydra.launcher.n_jobs=2
    torchrun --nproc_per_node=4 experiments/train.py algo=gspo       # one run over 4 processes (FSDP2)

Defaults live in the dataclasses of `moe_rl.config` (registered below); config groups and
presets in `experiments/conf/preset/` hold only deltas (`+preset=NAME experiment=MINE` names a run
from a preset). A run whose directory already holds a finished `status.json` is skipped, so rerunning
an interrupted multirun completes it.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from moe_rl.config import TrainConfig
from moe_rl.run.experiment import interrupted_line, refuse_old_preset_spelling, run_from_hydra
from moe_rl.tasks.rewards import TaskInputError

ConfigStore.instance().store(name="base_config", node=TrainConfig)
log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> str:
    try:
        return run_from_hydra(cfg, HydraConfig.get())
    except TaskInputError as err:  # the user's data or reward: one line (status.json and train.log keep the rest)
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:  # one line, not a traceback from inside transformers
        sys.exit(interrupted_line(HydraConfig.get().runtime.output_dir, cfg.checkpoint_every))


if __name__ == "__main__":
    os.environ["MOE_RL_COMMAND"] = shlex.join(sys.argv)  # meta.json's command, in every sweep worker
    refuse_old_preset_spelling(sys.argv[1:])  # `+experiment=NAME` is `+preset=NAME` now: one line, not Hydra's error
    if int(os.environ.get("RANK", "0")) > 0:  # torchrun's other ranks: rank 0 alone writes the run directory
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    main()
