"""Record, in each shipped run's meta.json that names no commit, the commit that first shipped it.

    python scripts/record_shipped_in.py [RESULTS_ROOT]

Runs made before meta.json recorded the commit carry `"git_sha": "unknown"`; the commit that added
their meta.json to the repository bounds the code that made them (that commit or an earlier one).
Reports then name it (`shipped_in`). Rerunnable: runs that name a commit, or already carry
`shipped_in`, are left alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from moe_rl.run.atomic import write_atomic
from moe_rl.run.folder import relative_paths


def first_commit(path: Path) -> str | None:
    out = subprocess.run(
        ["git", "log", "--diff-filter=A", "--format=%H", "--", str(path)], capture_output=True, text=True, check=False
    )
    shas = out.stdout.split()
    return shas[-1] if shas else None  # log lists newest first: the last is the commit that added it


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path("results")
    changed = 0
    for meta_path in sorted(root.rglob("meta.json")):
        meta = json.loads(meta_path.read_text())
        if meta.get("git_sha") not in (None, "unknown") or meta.get("shipped_in"):
            continue
        sha = first_commit(meta_path)
        if sha is None:
            print(f"{meta_path}: not committed yet, left alone", file=sys.stderr)
            continue
        meta["shipped_in"] = sha
        write_atomic(meta_path, json.dumps(meta, indent=1))
        changed += 1
    print(f"recorded shipped_in in {changed} meta.json file(s) under {root}")
    fixed = 0
    for config_path in sorted(root.rglob("config.yaml")):
        if ".hydra" in config_path.parts:
            continue
        text = config_path.read_text()
        cfg = yaml.safe_load(text) or {}
        out_dir = cfg.get("out_dir")
        if not (isinstance(out_dir, str) and Path(out_dir).is_absolute()):
            continue
        absolute = {k: v for k, v in cfg.items() if k != "results_dir" or Path(str(v)).is_absolute()}
        new = {**cfg, **relative_paths(absolute, Path(out_dir))}
        write_atomic(config_path, OmegaConf.to_yaml(OmegaConf.create(new)))
        fixed += 1
    print(f"made the paths of {fixed} config.yaml file(s) relative to their run folder")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
