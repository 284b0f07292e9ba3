"""Write a run's trained policy as a `save_pretrained` folder with its tokenizer.

    python -m moe_rl.export RUN_DIR OUT_DIR

The run must have kept its checkpoint (`keep_checkpoint=true`, which also saves the final step's
weights), or have been interrupted (its last checkpoint). The architecture and the tokenizer come
from the run's starting point (the cold start or `model.checkpoint`, recorded in meta.json); the
weights from `checkpoint.pt`. `AutoModelForCausalLM.from_pretrained(OUT_DIR)` and
`AutoTokenizer.from_pretrained(OUT_DIR)` load the result anywhere transformers runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_rl.run.folder import load_checkpoint


class ExportError(ValueError):
    """The run folder holds nothing to export; the message says what to do."""


def export_run(run_dir: str | Path, out_dir: str | Path) -> tuple[Path, int]:
    """Save RUN_DIR's policy (weights of its `checkpoint.pt`) and tokenizer to `out_dir`; return
    (out_dir, the step the weights are from)."""
    from moe_rl.loop.cold_start import load_tokenizer
    from moe_rl.models import load_model

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    meta_path, checkpoint = run_dir / "meta.json", run_dir / "checkpoint.pt"
    if not meta_path.is_file():
        raise ExportError(f"{run_dir} is not a run folder (no meta.json)")
    if not checkpoint.is_file():
        sharded = (run_dir / "checkpoint.json").is_file()
        raise ExportError(
            f"{run_dir} has no checkpoint.pt"
            + (" (a sharded torchrun checkpoint, which this does not read)" if sharded else "")
            + ": rerun the same command with keep_checkpoint=true, which keeps the final weights"
        )
    cold = json.loads(meta_path.read_text()).get("cold_start") or {}
    start = cold.get("path")
    if not start or not Path(start).exists():
        raise ExportError(
            f"{run_dir}: its starting point {start!r} (meta.json cold_start.path) is gone; rerun the "
            "cold start (the same command recreates it) before exporting"
        )
    state = load_checkpoint(checkpoint)
    model = load_model(start)
    model.load_state_dict(state["model"])
    tokenizer = load_tokenizer(start, cold)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir, int(state["step"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_rl.export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        out, step = export_run(args.run_dir, args.out_dir)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{out}: policy after step {step} and its tokenizer (save_pretrained)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
