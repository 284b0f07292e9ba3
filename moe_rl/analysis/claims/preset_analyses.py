"""Declared analyses: what an experiment file's `analysis` block declares, and the runs added after a look."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.claims.rules import PRIMARY, Claim

SWEEP_KEYS = {"seed": "seed", "optim.lr": "lr", "optim.updates_per_rollout": "N", "arm": "arm"}  # sweep -> run key


@dataclass
class Declared:
    """An experiment's declared analysis (its file's `analysis` block) and the extensions added to it."""

    experiment: str
    file: str
    analysis: dict
    extensions: list[dict] = field(default_factory=list)  # name, look, runs: {run key: values}


def _sweep_values(key: str, text: object) -> list:
    values = [v.strip() for v in str(text).split(",")]
    if key == "arm":  # arm files are named algo_replay; runs carry algo+replay
        return [v.replace("_", "+", 1) for v in values]
    return [float(v) for v in values]


def declared_analyses(folder: str | Path) -> dict[str, Declared]:
    """experiment -> its declared analysis, from the `analysis` blocks of the experiment files in
    `folder` (the presets, experiments/conf/preset). A file whose block says `extends: NAME` and
    `look: K` added runs to NAME after K - 1 looks at its results; its sweep parameters say which runs."""
    import yaml

    folder = Path(folder)
    docs = (
        {p.stem: yaml.safe_load(p.read_text()) or {} for p in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}
    )
    out: dict[str, Declared] = {}
    for name, doc in docs.items():
        block = doc.get("analysis")
        if isinstance(block, dict) and "extends" not in block:
            exp = str(doc.get("experiment", name))
            out[exp] = Declared(exp, (folder / f"{name}.yaml").as_posix(), block)
    for name, doc in docs.items():
        block = doc.get("analysis")
        if not (isinstance(block, dict) and "extends" in block):
            continue
        base = out.get(str(block["extends"]))
        if base is None:
            raise ValueError(f"{name}.yaml extends {block['extends']!r}, which declares no analysis")
        params = ((doc.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
        runs = {SWEEP_KEYS[k]: _sweep_values(SWEEP_KEYS[k], v) for k, v in params.items() if k in SWEEP_KEYS}
        base.extensions.append({"name": name, "look": int(block["look"]), "runs": runs})
    return out


def declared_or_none(folder: str | Path, experiment: str) -> Declared | None:
    """The declared analysis of `experiment` in `folder`; None where there is none or the files cannot be read."""
    try:
        return declared_analyses(folder).get(experiment)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def extension_of(outcomes: pd.DataFrame, declared: Declared | None) -> pd.Series:
    """Per run (index of `outcomes`), the extension that added it, "" for the declared runs."""
    out = pd.Series("", index=outcomes.index, dtype=object)
    for ext in declared.extensions if declared else []:
        hit = pd.Series(True, index=outcomes.index)
        for key, values in ext["runs"].items():
            col = outcomes[key]
            hit &= (
                col.isin(values)
                if key == "arm"
                else np.isclose(col.to_numpy(float)[:, None], np.asarray(values, float)[None, :]).any(1)
            )
        out[hit & (out == "")] = ext["name"]
    return out


def looks_note(
    c: Claim,
    declared: Declared | None,
    ext: pd.Series,
    without: str,
    primary_computed: list[str] = PRIMARY,
    unit: str = "runs",
) -> int:
    """The declared analysis and the extensions present; returns the number of looks."""
    if declared is None:
        c.notes.append("no declared analysis found for this experiment: one look assumed")
        return 1
    primary, claimed = list(declared.analysis.get("primary", [])), declared.analysis.get("claims", [])
    if primary != primary_computed:
        c.notes.append(
            f"**{declared.file} declares the primary outcomes {primary}; this report computes {primary_computed}**"
        )
    if claimed and c.id not in claimed:
        c.notes.append(f"**claim {c.id} is not among the claims {declared.file} declares ({claimed})**")
    present = [e for e in declared.extensions if (ext == e["name"]).any()]
    looks = max([1, *(e["look"] for e in present)])
    added = ", ".join(f"{e['name']} (look {e['look']}, {int((ext == e['name']).sum())} {unit})" for e in present)
    c.notes.append(
        f"declared in {declared.file}: primary {', '.join(declared.analysis.get('primary', []))}"
        + (
            f"; extensions added after looking at results: {added}; the verdict counts {looks} looks "
            f"(p x {looks}); without the extensions ({int((ext == '').sum())} declared {unit}, one look): "
            f"{without}"
            if present
            else "; no extension"
        )
    )
    return looks
