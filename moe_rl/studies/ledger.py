"""The cost ledger's study side (`python -m moe_rl.report --cost`): each declared study (experiments/conf/study/)
with its records and its verdicts, re-decided at every look it read, for `moe_rl.analysis.cost` to price.

A look j is re-decided by the one rule (`study_rule.decide`, then the study's Holm and matching checks,
`study_rule.correct`) on the admitted runs of the members of its blocks
(members[:looks[j]]), with those members' complete set as the runs that were in: what the study would have said
had it stopped there. The look from which every verdict equals its final one is where it settled
(`cost.settled_look`); the runs of the looks read after it moved no verdict.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from moe_rl.analysis import cost
from moe_rl.analysis.claims import runs_folder
from moe_rl.studies import study_rule
from moe_rl.studies.design import Study, load_study, study_files

DECIDED = (study_rule.REPRODUCED, study_rule.NOT_REPRODUCED)


def verdicts_by_look(study: Study, result: study_rule.StudyResult) -> list[list[str]]:
    """The verdict of every contrast at each look the runs reached, in order; the last is the study's own."""
    runs = result.runs
    ran = study_rule.complete_members(study, runs)
    reached = study_rule.looks_reached(study, ran)
    if not reached:
        return []
    admitted = runs[runs["admitted"].astype(bool)]
    member = admitted["seed"].astype(int) % study.member_pool
    out = []
    for j in range(reached - 1):
        block = set(study.members[: study.design.looks[j]])
        at = admitted[member.isin(block)]
        rows = pd.DataFrame([study_rule.decide(study, at, c, ran & block) for c in study.contrasts])
        out.append([str(w) for w in study_rule.correct(study, rows)["verdict"]])  # Holm and matching, as the study
    return [*out, [str(v) for v in result.verdicts["verdict"]]]


def study_cost(study: Study, root: Path) -> cost.StudyCost:
    """A study's records (runs under root/<study>/runs; pilots under root/<study>/pilot* and, matched per start, the
    probes under root/<study>/probes, priced as pilots) and verdicts."""
    folder = Path(root) / study.name
    runs_dir = runs_folder(Path(root), study.name)
    overhead = [*sorted(folder.glob("pilot*")), folder / "probes"]
    pilots = tuple(r for p in overhead if p.is_dir() for r in cost.records(p))
    claims = tuple(dict.fromkeys(c.claim for c in study.contrasts if c.claim != "exploratory"))
    runs = tuple(cost.records(runs_dir)) if runs_dir.is_dir() else ()
    try:
        result = study_rule.analyse(study, runs_dir)
    except (FileNotFoundError, ValueError) as err:
        return cost.StudyCost(study.name, runs, pilots, study.member_pool, claims, (), note=f"no verdicts: {err}")
    by_look = verdicts_by_look(study, result)
    settled, looks = cost.settled_look(by_look), study.design.looks
    v = result.verdicts
    decided = tuple(
        dict.fromkeys(
            str(c) for c, w in zip(v["claim"], v["verdict"], strict=True) if c != "exploratory" and w in DECIDED
        )
    )
    return cost.StudyCost(
        study.name,
        runs,
        pilots,
        study.member_pool,
        claims,
        decided,
        after=cost.members_after(study.members, looks, settled, len(by_look)),
        settled=f"look {settled} of {len(looks)} ({len(by_look)} read)" if by_look else "no look read",
        geometry=reference_model(study, result.runs),
    )


def reference_model(study: Study, runs: pd.DataFrame) -> str:
    """The model a study matched per start ran its reference arm on (`study_rule.model_label`); "" for a study not
    matched per start, or without those runs."""
    if study.match is None or study.match.reference is None or "model" not in runs:
        return ""
    models = [str(m) for m in runs.loc[runs["arm"] == study.match.reference, "model"] if str(m)]
    return models[0] if models else ""


def ledger(root: Path, studies_dir: Path, warmup_s: float | None = None) -> list[str]:
    """The ledger's lines for every study declared in `studies_dir` whose folder is under `root`."""
    costs = [
        study_cost(study, root)
        for study in (load_study(p) for p in study_files(studies_dir))
        if (Path(root) / study.name).is_dir()
    ]
    return cost.ledger_lines(cost.ledger_table(costs, warmup_s), Path(root), timed=warmup_s is not None)
