"""The analysis side imports no torch or transformers (docs/design.md §5): reports and claims run where
neither is installed, and `python -m moe_rl.report` starts fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> set[str]:
    """Top-level package names in sys.modules after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_analysis_imports_no_torch() -> None:
    loaded = _modules_after(
        "import moe_rl.report, moe_rl.analysis, moe_rl.analysis.claims, moe_rl.analysis.configs, "
        "moe_rl.analysis.shift, moe_rl.run.identity"
    )
    assert "moe_rl" in loaded
    assert not loaded & {"torch", "transformers"}, sorted(loaded & {"torch", "transformers"})


def test_run_identity_is_torch_free_and_matches_config_hash() -> None:
    """`moe_rl.run.identity` hashes a config dict without torch; `config_hash` is that hash."""
    assert not _modules_after("from moe_rl.run.identity import identity_hash, identity_spec") & {
        "torch",
        "transformers",
    }
    from moe_rl.config import TrainConfig, config_hash
    from moe_rl.run.identity import identity_hash

    cfg = TrainConfig()
    assert config_hash(cfg) == identity_hash(cfg.to_dict())
    cfg.seed += 1
    assert config_hash(cfg) != identity_hash(TrainConfig().to_dict())


def test_analysis_modules_import_no_private_names() -> None:
    """No analysis module imports another's underscore helpers (a helper two modules share has a public
    name where it belongs). Module size has no cap (docs/testing.md: scripts/largest_modules.py)."""
    import ast

    private = []
    for path in sorted((ROOT / "moe_rl" / "analysis").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_rl."):
                private += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []
