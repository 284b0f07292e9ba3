"""The scale paragraph of CLAIMS.md: which models and tasks the verdicts come from."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from moe_rl.analysis.claims.cells import runs_folder

PAPER_SCALE = (
    "Qwen3-30B-A3B (hidden size 2048, 48 MoE layers, 128 experts, top-8) trained on mathematics and code (GSPO, R3)"
)


def _span(values: pd.Series, fmt: str = "g") -> str:
    vals = sorted(values.dropna().unique())
    if not vals:
        return "?"
    return f"{vals[0]:{fmt}}" if len(vals) == 1 else f"{vals[0]:{fmt}}-{vals[-1]:{fmt}}"


def models_and_tasks(root: str | Path, experiments: tuple[str, ...]) -> str:
    """A sentence naming the models and tasks behind the verdicts, read from the runs' config.yaml."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    rows = []
    for exp in experiments:
        folder = runs_folder(Path(root), exp)
        for path in sorted(folder.glob("*/config.yaml")) if folder.is_dir() else []:
            doc = yaml.load(path.read_text(), Loader=loader) or {}
            model, task = doc.get("model") or {}, doc.get("task") or {}
            rows.append(
                {
                    "experiment": exp,
                    "family": model.get("family"),
                    "hidden": model.get("hidden_size"),
                    "layers": model.get("num_layers"),
                    "experts": model.get("num_experts"),
                    "top_k": model.get("top_k"),
                    "task": task.get("name"),
                    "steps": doc.get("steps"),
                    "device": doc.get("device"),
                    "engine": (doc.get("rollout") or {}).get("engine", "hf"),
                    "rollout_dtype": (doc.get("rollout") or {}).get("dtype"),
                }
            )
    if not rows:
        return ""
    f = pd.DataFrame(rows)
    counts = ", ".join(f"{exp} {n}" for exp, n in f.groupby("experiment", sort=False).size().items())
    families = ", ".join(sorted(f["family"].dropna().astype(str).unique()))
    tasks = ", ".join(f"`{t}`" for t in sorted(f["task"].dropna().astype(str).unique()))
    devices = ", ".join(sorted(f["device"].dropna().astype(str).unique()))
    engine = f[f["engine"] == "vllm"]
    engine_text = (
        f"; the rollouts of {', '.join(sorted(engine['experiment'].unique()))} come from an in-process vLLM engine "
        f"(CPU build) in {', '.join(sorted(engine['rollout_dtype'].dropna().astype(str).unique()))}, the others from "
        "the harness's own sampling (`moe_rl.rollout`)"
        if len(engine)
        else ""
    )
    return (
        f"**Scale.** Every verdict below comes from tiny models on a synthetic task, not from the papers' models: "
        f"{families} with hidden size {_span(f['hidden'])}, {_span(f['layers'])} layers, {_span(f['experts'])} "
        f"experts and top-{_span(f['top_k'])} routing, trained with RL for {_span(f['steps'])} steps per run on "
        f"{tasks} (a synthetic task with an exact reward) from a supervised cold start, on {devices} "
        f"({len(f)} runs: {counts}){engine_text}. The papers' numbers come from models such as {PAPER_SCALE}. A verdict says "
        "what happens at this scale; it does not refute a result measured at the papers' scale."
    )
