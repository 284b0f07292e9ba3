"""The rule of a declared study (`moe_rl.studies.design`): per-run outcomes, pairs, each contrast decided by the one
rule at its look, the cell and starts tables. Its report is `study_report`, its claims on CLAIMS.md
`study_claims`.

The rule (`decide`), for a contrast sum_c w_c * outcome(c) paired on the run seed (`pair_values`) and reduced to
start means (a start: the cold start, or the pool member where the cells are two models or the study declares
`unit.start: member`):
- **untestable here** where the contrast cannot differ: most runs of every cell it reads sit at the floor (late
  accuracy 0) or at the ceiling (1); for a run-mean outcome, most runs of any one cell at a bound (`bound_reason`);
  or the reference does not degrade (its declared `requires` combination's mean is not below its bound);
- **reproduced** where, at the first look that reaches it (looks read in order, each on its members), the one-sided
  t on start means, read as a z (`sequential.t_to_z`), reaches the look's O'Brien-Fleming-type boundary
  (`sequential.boundaries` at the information reached, alpha spent one-sided in the claimed direction);
- **not reproduced** at the last look where the repeated confidence interval (the t interval at the level the
  look's boundary spends, so that it excludes 0 in the claimed direction exactly when the boundary is reached) lies
  inside +-margin or wholly on the other side of 0;
- **inconclusive** otherwise: before the last look "continue", at it with the difference the starts could have
  detected at the declared power (`power.detectable_difference`).

A look is read once every member of its block has all its runs in (`complete_members`; a look partly run is not
read, so a study stopped mid-look decides at its last complete one), on the starts the study admits (`unit.admit`);
a look with fewer than 3 admitted starts, or none more than the look before, spends no alpha and is skipped.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy import stats

from moe_rl.analysis.clustered import cluster_means
from moe_rl.analysis.configs import cold_start_meta, run_meta
from moe_rl.analysis.dose import acting_kl_per_run
from moe_rl.analysis.load import load_results
from moe_rl.analysis.outcomes import finished_runs
from moe_rl.analysis.power import (
    detectable_difference,
    run_wall_s,
    start_mean_interval,
    starts_needed,
    t_interval,
    variance_components,
)
from moe_rl.analysis.preregistration import Preregistration, declaration_history
from moe_rl.analysis.provenance import load_provenance, provenance_line
from moe_rl.analysis.sequential import (
    EFFICACY,
    END,
    EXCLUDED,
    FUTILITY,
    Look,
    information,
    read_looks,
    repeated_p_value,
    stop_of,
)
from moe_rl.metrics.names import (
    KL_UPDATE_K3,
    KL_UPDATE_K3_ACTING,
    RATIO_SPLIT_ROUTING_SHARE,
    ROUTE_FLIP_RATE,
    TASK_ACCURACY,
    offpolicy_key,
)
from moe_rl.studies.design import (
    MIN_STARTS,
    OUTCOMES,
    POOL,
    TWINS_UNIT,
    Contrast,
    Study,
    load_study,
    member_start,
)
from moe_rl.studies.secondary import KEYS as SECONDARY_KEYS
from moe_rl.studies.secondary import SECONDARY, per_run_secondary, secondary_table

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, UNTESTABLE = "reproduced", "not reproduced", "inconclusive", "untestable here"
UNMATCHED = "unmatched"  # a matched contrast read away from its reference's divergence: no verdict either way
# an exploratory contrast reproduces nothing: the same rule, its outcomes named for what they say
DETECTED, NEGLIGIBLE, AGAINST = "detected", "negligible", "against"
NOTED_CONTRASTS = 6  # a claim's notes list its study's exploratory contrasts too where it declares at most this many
BOUND_SHARE = 0.5  # a cell sits at a bound when more than this share of its runs ends there
RUN_MEANS = {"routing_share": RATIO_SPLIT_ROUTING_SHARE, "drift": offpolicy_key(ROUTE_FLIP_RATE)}  # outcome: key
KEYS = (TASK_ACCURACY, KL_UPDATE_K3, KL_UPDATE_K3_ACTING, *RUN_MEANS.values())


@dataclass
class StudyResult:
    runs: pd.DataFrame  # one row per finished run: cell, arm, level, start, seed, outcome, covariates
    cells: pd.DataFrame
    verdicts: pd.DataFrame
    starts: pd.DataFrame
    domains: list[str]  # numerics domains of the runs ("avx2, eager")
    provenance: str
    secondary: pd.DataFrame = field(default_factory=pd.DataFrame)  # the mission's outcomes per contrast
    preregistration: Preregistration | None = None  # the declaration's history from git against its runs' commits


def _cell_frames(runs_dir: Path, keys: list[str], study: Study | None) -> list[tuple[str, pd.DataFrame]]:
    """(cell, its runs' metrics) of each cell with runs: each <arm>@<level>/ folder, or for a study `as_ran` the
    runs its cells' overrides name, with the study's run seed (`design.AsRan.cell_and_seed`)."""
    if study is None or study.as_ran is None:
        dirs = sorted(p for p in runs_dir.iterdir() if p.is_dir() and "@" in p.name)
        return [(d.name, load_results(d, keys=keys)) for d in dirs if any(d.rglob("metrics.parquet"))]
    cells, pool = study.as_ran_cells(), study.member_pool
    found = {p.name: hit for p in runs_dir.iterdir() if (hit := study.as_ran.cell_and_seed(p.name, cells, pool))}
    if not found:
        return []
    df = pd.concat([load_results(runs_dir / n, keys=keys) for n in sorted(found)], ignore_index=True)
    name = df["run_dir"].map(lambda r: Path(r).name)
    df["seed"] = name.map(lambda n: found[n][1]).astype(int)
    cell = name.map(lambda n: found[n][0])
    return [(c, df[cell == c]) for c in sorted(set(cell))]


def _cell_runs(df: pd.DataFrame, cell: str, columns: dict[str, str]) -> pd.DataFrame:
    """One cell's finished runs (`per_run`'s columns before the covariates)."""
    table = finished_runs(df)
    arm, level = cell.split("@", 1)
    table["arm"], table["level"], table["cell"] = arm, level, cell
    table = table.join(acting_kl_per_run(df)) if (df["key"] == KL_UPDATE_K3).any() else table
    table = table.join(per_run_secondary(df))
    for outcome, key in {**RUN_MEANS, **columns}.items():
        table[outcome] = df[df["key"] == key].groupby("run")["value"].mean().reindex(table.index)
    return table.reset_index(drop=True)


def per_run(runs_dir: Path, columns: dict[str, str] | None = None, study: Study | None = None) -> pd.DataFrame:
    """Every finished run under `runs_dir`/<arm>@<level>/ (a study `as_ran`: the runs in `runs_dir` its cells'
    overrides name, `design.AsRan`): its cell, start (the cold start's unit), seed, outcomes (`design.OUTCOMES`:
    `change`, late minus step-0 accuracy; the run means of `RUN_MEANS`, NaN where the run did not log them), late
    accuracy, collapse label, early per-update KL on the routes it acts with (`kl_acting`, `dose.acting_kl_per_run`)
    and the run mean of each of `columns` (name: metric key; NaN where not logged)."""
    columns = columns or {}
    keys = list(dict.fromkeys([*KEYS, *SECONDARY_KEYS, *columns.values()]))
    frames = [_cell_runs(df, cell, columns) for cell, df in _cell_frames(Path(runs_dir), keys, study)]
    if not frames:
        raise FileNotFoundError(f"no finished runs under {runs_dir}/<arm>@<level>/")
    out = pd.concat(frames, ignore_index=True)
    if "kl_acting" not in out:
        out["kl_acting"] = np.nan
    keep = ["run", "cell", "arm", "level", "start", "seed", "status", "start_accuracy", "late_accuracy", *OUTCOMES]
    out["log_kl_acting"] = np.log(out["kl_acting"].where(out["kl_acting"] > 0))
    out["wall_s"] = [run_wall_s(Path(str(r))) for r in out["run_dir"]]
    warmups = [cold_start_meta(Path(str(r))) for r in out["run_dir"]]
    covariates = [w.get("covariates") or {} for w in warmups]
    out["warmup"] = [w.get("key") for w in warmups]
    out["greedy_accuracy"] = [c.get("greedy_accuracy", np.nan) for c in covariates]
    out["sampled_reward"] = [c.get("sampled_reward", np.nan) for c in covariates]
    out["zero_variance"] = [zero_variance_share(c.get("pass_counts")) for c in covariates]
    out["in_band"] = [w.get("in_band") is not False for w in warmups]  # None: no warm-up (a checkpoint as it is)
    covs = ["warmup", "greedy_accuracy", "sampled_reward", "zero_variance", "in_band"]
    out["collapsed"] = out["collapsed"].astype(float)
    out["model"] = [model_label(Path(str(r))) for r in out["run_dir"]]
    secondary = [c for c in SECONDARY if c != "collapsed"]
    return out[
        [*keep, *columns, "collapsed", *secondary, "kl_acting", "log_kl_acting", *covs, "model", "wall_s", "run_dir"]
    ]


def model_label(run_dir: Path) -> str:
    """The model a run trained, in a few words: family, experts, top-k, MoE layers (from its config.yaml)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return ""
    m = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
    if not m.get("num_experts") or "dense" in str(m.get("family", "")):
        return f"{m.get('family', '?')} dense, {m.get('num_layers', '?')} layers"
    return f"{m.get('family', '?')} E={m['num_experts']} k={m.get('top_k', '?')} L={m.get('num_layers', '?')}"


def zero_variance_share(pass_counts: list[int] | None) -> float:
    """The share of held-out prompts whose n samples were all wrong or all right (`pass_counts[c]`: prompts with c
    of n right): where a GRPO group of n has no reward variance, so no signal. NaN where not recorded."""
    if not pass_counts or sum(pass_counts) == 0:
        return math.nan
    return (pass_counts[0] + pass_counts[-1]) / sum(pass_counts)


def pair_values(
    runs: pd.DataFrame, weights: dict[tuple[str, str], float], outcome: str, pool: int = POOL
) -> pd.DataFrame:
    """Per run seed where every cell of `weights` ran: the combination sum_c w_c * outcome (column `value`), with
    the block it belongs to (`start`): the cold start where every cell ran from the same one, else its pool member
    (`member m`): arms on two models start from two warm-ups of member m, which share the member's prompts and
    sampling seeds and pair as a block. Two runs of one cell at one seed are an error, not a choice."""
    cols = {f"{a}@{lv}": w for (a, lv), w in weights.items()}
    used = runs[runs["cell"].isin(list(cols))]
    twice = used[used.duplicated(["cell", "seed"], keep=False)]
    if len(twice):
        raise ValueError(f"runs repeat (cell, seed): {sorted(set(map(tuple, twice[['cell', 'seed']].values)))[:3]}")
    wide = used.pivot(index="seed", columns="cell", values=outcome)
    if not set(cols) <= set(wide.columns):
        return pd.DataFrame(columns=["start", "seed", "value"])
    wide = wide[list(cols)].dropna()
    by_seed = used.groupby("seed")["start"]
    distinct, first = by_seed.nunique(), by_seed.first()
    block = [first[s] if distinct[s] == 1 else member_start(s, pool) for s in wide.index]
    value = sum(wide[c] * w for c, w in cols.items())
    return pd.DataFrame({"start": block, "seed": wide.index, "value": np.asarray(value, dtype=float)})


def bound_reason(runs: pd.DataFrame, contrast: Contrast, outcome: str = "change") -> str | None:
    """Why the contrast's cells cannot differ: most runs of every cell at the floor, or at the ceiling; for a run
    mean (`outcome` other than `change`), most runs of any one cell at the floor or the ceiling, where every sample
    of a group scores alike, so the mean is read over steps without a policy gradient; else None (also while some
    cell has no run yet). A run's bound is its final accuracy: a run that reaches it late in its steps counts as
    at it, which suits runs that collapse early (the length study's, by step ~11 of 200), not late ones."""
    names = [f"{a}@{lv}" for a, lv in contrast.weights]
    cells = runs[runs["cell"].isin(names)]
    if set(cells["cell"]) != set(names):
        return None
    by = cells.groupby("cell")["late_accuracy"]
    floor, ceiling = by.apply(lambda v: (v <= 0).mean()), by.apply(lambda v: (v >= 1).mean())
    if (floor > BOUND_SHARE).all():
        return f"floor: most runs of every cell end at accuracy 0 ({floor.min():.0%}-{floor.max():.0%})"
    if (ceiling > BOUND_SHARE).all():
        return f"ceiling: most runs of every cell end at accuracy 1 ({ceiling.min():.0%}-{ceiling.max():.0%})"
    if outcome == "change":
        return None
    for word, share, bound in (("floor", floor, 0), ("ceiling", ceiling, 1)):
        if (share > BOUND_SHARE).any():
            cell = share.idxmax()
            return (
                f"{word}: {share[cell]:.0%} of {cell}'s runs end at accuracy {bound}, so its run mean of "
                f"`{outcome}` is read over steps without a policy gradient"
            )
    return None


def pair_members(pairs: pd.DataFrame, pool: int = POOL) -> pd.Series:
    """Each pair's pool member (run seed m + r * pool starts from member m)."""
    return pairs["seed"].astype(int) % pool


def complete_members(study: Study, runs: pd.DataFrame) -> set[int]:
    """The pool members whose runs are all in: a finished run (admitted or not) of every seed the study runs of
    them in every cell (`Study.seeds`: each replicate, less the seeds a cell skipped as it ran)."""
    due = {(f"{a}@{lv}", s) for a, lv in study.cells() for s in study.seeds(len(study.members), (a, lv))}
    missing = due - set(zip(runs["cell"], runs["seed"].astype(int), strict=True))
    return set(study.members) - {s % study.member_pool for _, s in missing}


def looks_reached(study: Study, complete: set[int]) -> int:
    """How many declared looks the study's runs have reached, in order: look j is reached once every member of its
    block (members[looks[j-1]:looks[j]]) is `complete` (`complete_members`): a look partly run is not read."""
    n, first = 0, 0
    for last in study.design.looks:
        if not complete.issuperset(study.members[first:last]):
            break
        n, first = n + 1, last
    return n


def usable_looks(study: Study, pairs: pd.DataFrame, member: pd.Series, reached: int) -> list[tuple[int, int]]:
    """(look index, starts) of the reached looks a contrast is decided at: look j's information is the starts among
    members[:looks[j]] with a pair (fewer than declared where runs failed or starts were not admitted); a look with
    fewer than MIN_STARTS, or adding no start to the previous one, spends nothing and is skipped."""
    out: list[tuple[int, int]] = []
    for j in range(reached):
        c = int(pairs.loc[member.isin(study.members[: study.design.looks[j]]), "start"].nunique())
        if c >= MIN_STARTS and (not out or c > out[-1][1]):
            out.append((j, c))
    return out


def kl_match(pairs: pd.DataFrame, runs: pd.DataFrame, contrast: Contrast, pool: int = POOL) -> dict[str, float]:
    """Beside the declared estimate (`pairs`: the contrast's `pair_values` of the outcome, on the finished `runs`),
    the divergence it was read at: `kl_ratio`, exp of the mean over starts of the contrast's combination of log
    early acting KL (for arm minus reference, the geometric mean of the per-start ratio arm / reference; 1.0: the
    cells ran at equal divergence), with its 95% t interval over starts (`kl_lo`, `kl_hi`). NaN where no start
    has both; no interval under 2 starts."""
    log_kl = pair_values(runs, contrast.weights, "log_kl_acting", pool)
    both = pairs.merge(log_kl.drop(columns="start"), on="seed", suffixes=("", "_kl")).dropna()
    out = dict.fromkeys(("kl_ratio", "kl_lo", "kl_hi"), math.nan)
    if both.empty:
        return out
    by = both.groupby("start")["value_kl"].mean()
    out["kl_ratio"] = float(np.exp(by.mean()))
    if len(by) >= 2:
        _, lo, hi, _, _ = t_interval(by.to_numpy(float))
        out.update(kl_lo=float(np.exp(lo)), kl_hi=float(np.exp(hi)))
    return out


def read_on(runs: pd.DataFrame, contrast: Contrast) -> str:
    """The model a contrast was read on and routing's share of the token log-ratio variance there: the model labels
    of its cells' runs, and the mean over its reference cells' runs (`requires`, else its cells of negative weight)
    of their run mean of `ratio/split/routing_share`."""
    names = [f"{a}@{lv}" for a, lv in contrast.weights]
    ref = [f"{a}@{lv}" for a, lv in (contrast.requires or {k: w for k, w in contrast.weights.items() if w < 0})]
    if "model" not in runs:  # a table built by hand (tests)
        return ""
    models = "; ".join(x for x in dict.fromkeys(runs.loc[runs["cell"].isin(names), "model"]) if x)
    return f"{models or 'model not recorded'}; {routing_share_text(runs, ref)}"


def routing_share_text(runs: pd.DataFrame, cells: list[str]) -> str:
    """The mean over `cells`' runs of their run mean of `ratio/split/routing_share`, in words."""
    share = runs.loc[runs["cell"].isin(cells), "routing_share"].dropna() if "routing_share" in runs else pd.Series()
    return f"routing's share of the ratio variance {share.mean():.0%}" if len(share) else "routing share not logged"


def look_samples(study: Study, pairs: pd.DataFrame, looks: list[tuple[int, int]]) -> list[np.ndarray]:
    """The start means of `pairs` at each usable look (`usable_looks`), cumulative."""
    member = pair_members(pairs, study.member_pool)
    out = []
    for j, _ in looks:
        at = pairs[member.isin(study.members[: study.design.looks[j]])]
        out.append(cluster_means(at["value"], at["start"]))  # (C_j,)
    return out


def verdict(
    *,
    untestable: str | None,
    reached: bool,
    reached_reason: str,
    last: bool,
    lo: float,
    hi: float,
    margin: float,
    sign: float,
    open_reason: str,
    exploratory: bool = False,
    futile: str | None = None,
    where: str = "",
) -> tuple[str, str]:
    """The one rule's verdict and reason, for every claim: **untestable here** where the runs cannot show what the
    claim speaks of (`untestable`: a floor, a ceiling, a reference that does not degrade, a quantity this scale
    cannot measure); **reproduced** where the claim's test reaches its level in the claimed direction (`reached`);
    **not reproduced** where a futility boundary was crossed (`futile`, its reason) or, at a look that can stop
    (`last`), the one-sided bound of [lo, hi] in the claimed direction (`sign`) excludes an effect as large as
    `margin`; **inconclusive** otherwise (`open_reason`: before the last look, what would continue; at it, what the
    runs could have detected). An exploratory contrast reproduces nothing: its outcomes are named `detected`,
    `negligible` and `against` (its bound below 0). `where`: the look, appended to the reason."""
    if untestable is not None:
        return UNTESTABLE, untestable
    if reached:
        return (DETECTED if exploratory else REPRODUCED), reached_reason
    bound = hi if sign > 0 else -lo  # sign x effect <= bound
    if futile is not None or (last and bound < margin):
        reason = futile or (
            f"an effect of {sign * margin:+g} in the claimed direction excluded: one-sided bound "
            f"{sign * bound:+.3f}{where}"
        )
        if exploratory:
            return (AGAINST if bound < 0 else NEGLIGIBLE), reason
        return NOT_REPRODUCED, reason
    return INCONCLUSIVE, open_reason


def _reason(look: Look, j: int, last_reason: str) -> str:
    """Why the reading stopped at `look` (the j-th declared look) where it reached efficacy, crossed futility or
    read on: the rule's reason for an exclusion is `verdict`'s."""
    if look.decision == EFFICACY:
        return f"z {look.z:.2f} >= boundary {look.efficacy:.2f} at look {j}"
    if look.decision == FUTILITY:
        return f"futility stop at look {j}: z {look.z:.2f} < futility boundary {look.futility:.2f}"
    if look.decision == END:
        return last_reason
    return f"continue: z {look.z:.2f} in ({look.futility:.2f}, {look.efficacy:.2f}) at look {j}"


def decide(study: Study, runs: pd.DataFrame, contrast: Contrast, ran: set[int] | None = None) -> dict[str, object]:
    """The one rule (module docstring) for `contrast` on the finished (admitted) `runs`: its verdict and reason, the
    look that decided it and its starts, the estimate (mean of start means, in the contrast's units) with its
    repeated confidence interval and one-sided bound, the repeated p-value, the variance components over every pair
    and the difference the starts could detect. `ran`: the members whose runs are all in, admitted or not
    (`complete_members`), which say how far the looks have reached (default: those of `runs`). Holm across the
    study's claims and the matching checks are the study's (`correct`)."""
    d, mde = study.design, study.mde_of(contrast)
    pool = study.member_pool
    pairs = pair_values(runs, contrast.weights, study.outcome_of(contrast), pool).dropna(subset=["value"])
    C_all = int(pairs["start"].nunique()) if len(pairs) else 0
    members = bool(len(pairs)) and pairs["start"].astype(str).str.startswith("member ").all()
    row: dict[str, object] = {"contrast": contrast.name, "claim": contrast.claim, "direction": contrast.direction}
    row["outcome"] = study.outcome_of(contrast)
    row["unit"] = (
        TWINS_UNIT
        if study.by_member
        else "pool members (a warm-up of each per model or length)"
        if members
        else "cold starts"
    )
    row.update(starts=C_all, pairs=len(pairs), estimate=float(pairs["value"].groupby(pairs["start"]).mean().mean()))
    row.update(kl_match(pairs, runs, contrast, pool))
    row["read_on"] = read_on(runs, contrast)
    comp = variance_components(pairs, "start", "value") if C_all >= 2 else None
    m = len(pairs) / C_all if C_all else math.nan
    if comp is not None:
        row.update(sd_between=comp.sd_between, sd_within=comp.sd_within, icc=comp.icc)
        row["detectable"] = detectable_difference(comp.sd_between, comp.sd_within, C_all, m, d.power, d.alpha, sides=1)
        row["starts_for_mde"] = starts_needed(comp.sd_between, comp.sd_within, mde, m, d.power, d.alpha, sides=1)
    why = bound_reason(runs, contrast, study.outcome_of(contrast))
    ref_mean = math.nan
    if contrast.requires:
        ref = pair_values(runs, contrast.requires, study.outcome, pool)
        ref_mean = float(ref["value"].groupby(ref["start"]).mean().mean()) if len(ref) else math.nan
        row["reference"] = ref_mean
        if why is None and not len(ref):
            why = "no runs of the reference's cells yet"
        elif why is None and not ref_mean < contrast.requires_below:
            why = f"the reference does not degrade: {100 * ref_mean:+.1f} pp, not below {100 * contrast.requires_below:+.1f}"
    margin = study.margin_of(contrast)
    row["margin_absolute"] = margin
    if d.margin_relative is not None and contrast.margin is None and ref_mean < 0:
        margin = d.margin_relative * -ref_mean  # a share of the reference's own loss
    row["margin"] = margin
    member = pair_members(pairs, pool)
    reached = looks_reached(study, ran if ran is not None else complete_members(study, runs))
    looks = usable_looks(study, pairs, member, reached)
    final = reached == len(d.looks)  # the last declared look (its pool exhausted, failed runs or not)
    row["final"] = final
    if not looks:
        row.update(verdict=INCONCLUSIVE, look=0, lo=math.nan, hi=math.nan, p_repeated=math.nan, stopped=False)
        row["reason"] = (
            f"pool limit reached with {C_all} start{'' if C_all == 1 else 's'}, fewer than {MIN_STARTS}"
            if final
            else f"{C_all} starts: before the first look at {d.looks[0]}"
        ) + (f" ({why})" if why else "")
        return row
    samples = look_samples(study, pairs, looks)
    read = read_looks(
        samples,
        d.looks[-1],
        final,
        sign=contrast.sign,
        alpha=d.alpha,
        beta=1 - d.power,
        mde=mde,
        margin=margin,
        futility=d.futility,
    )
    look = stop_of(read)
    at = read.index(look)
    j = looks[at][0]
    info = information([len(m) for m in samples], d.looks[-1], final)
    row.update(look=j + 1, look_starts=look.starts, estimate=look.mean, z=look.z, boundary=look.efficacy)
    row.update(futility=look.futility, lo=look.lo, hi=look.hi, bound=contrast.sign * look.bound)
    row["level"] = 1 - 2 * float(stats.norm.sf(look.efficacy))
    row["p_repeated"] = repeated_p_value(info, [r.z for r in read[: at + 1]])
    row["stopped"] = look.decision in (EFFICACY, EXCLUDED, FUTILITY) and why is None
    row["looks_past_stop"] = len(looks) - (at + 1) if row["stopped"] else 0  # looks run after the rule stopped
    row["stop"] = look.decision
    crossed = [looks[i][0] + 1 for i, r in enumerate(read[:-1]) if r.decision == FUTILITY]
    row["futility_crossed"] = crossed[0] if crossed else 0  # a futility look the study ran on past (non-binding)
    detectable = float(row.get("detectable", math.nan))  # type: ignore[arg-type]
    last_reason = f"pool limit reached; detectable at {d.power:.0%}: {detectable:.3f}"
    reason = _reason(look, j + 1, last_reason)
    word, reason = verdict(
        untestable=why,
        reached=look.decision == EFFICACY,
        reached_reason=reason,
        last=look.decision in (EXCLUDED, END),
        lo=look.lo,
        hi=look.hi,
        margin=margin,
        sign=contrast.sign,
        open_reason=reason,
        exploratory=contrast.claim == "exploratory",
        futile=reason if look.decision == FUTILITY else None,
        where=f" (repeated, at look {j + 1})",
    )
    row.update(verdict=word, reason=reason)
    return row


def holm(p: dict[str, float], alpha: float) -> dict[str, bool]:
    """Holm's step-down over a family of p-values: whether each hypothesis is rejected at family-wise `alpha`."""
    order = sorted(p, key=lambda k: p[k])
    out = dict.fromkeys(p, False)
    for i, name in enumerate(order):
        if not p[name] <= alpha / (len(order) - i):
            break
        out[name] = True
    return out


def correct(study: Study, verdicts: pd.DataFrame) -> pd.DataFrame:
    """The study-level checks on its contrasts' verdicts (`decide`'s rows):
    - **Holm** across its claim contrasts that were tested (not exploratory, not the placebo, not untestable), on
      their repeated p-values: a contrast that reaches its own boundary but not Holm's reads inconclusive (column
      `holm`: passes / fails / blank where not in the family);
    - **matching** (`match`): a matched contrast whose realised divergence ratio lies outside the declared tolerance
      reads **unmatched**, and so does every matched contrast where the placebo's estimate lies outside its margin."""
    v = verdicts.copy()
    placebo = study.match.placebo if study.match else None
    family = v[(v["claim"] != "exploratory") & (v["contrast"] != placebo) & (v["verdict"] != UNTESTABLE)]
    family = family[family["p_repeated"].notna()]
    passes = holm(dict(zip(family["contrast"], family["p_repeated"].astype(float), strict=True)), study.design.alpha)
    reached = v["reason"].astype(str).str.startswith("z ") & v["verdict"].isin([REPRODUCED])
    v["holm"] = [
        ("passes" if passes[c] else "fails") if c in passes and r else "" for c, r in zip(v["contrast"], reached)
    ]
    for i, r in v.iterrows():
        if r["verdict"] == REPRODUCED and r["holm"] == "fails":
            v.loc[i, "verdict"] = INCONCLUSIVE
            v.loc[i, "stopped"] = False
            v.loc[i, "reason"] = (
                f"{r['reason']}, but not Holm's across the study's {len(passes)} claims (repeated p "
                f"{float(r['p_repeated']):.4f})" + ("" if r["final"] else "; continue")
            )
    if study.match is None:
        return v
    m = study.match
    placebo_row = v[v["contrast"] == placebo]
    placebo_off = None
    if len(placebo_row):
        pr = placebo_row.iloc[0]
        if abs(float(pr["estimate"])) > float(pr["margin"]):
            placebo_off = (
                f"the placebo ({placebo}) reads {100 * float(pr['estimate']):+.1f} pp, outside +-{100 * float(pr['margin']):g}: "
                "the matching adds more than the margin"
            )
    for i, r in v.iterrows():
        if not m.covers(str(r["contrast"])) or r["verdict"] == UNTESTABLE:
            continue
        ratio = float(r["kl_ratio"])
        if not 1 / m.tolerance <= ratio <= m.tolerance:
            why = (
                f"divergence ratio {ratio:.3f} [{float(r['kl_lo']):.2f}, {float(r['kl_hi']):.2f}] outside its "
                f"tolerance [{1 / m.tolerance:.3f}, {m.tolerance:g}]"
            )
        elif placebo_off is not None:
            why = placebo_off
        else:
            continue
        v.loc[i, "verdict"] = UNMATCHED
        v.loc[i, "reason"] = f"{why}; by the rule alone: {r['verdict']} ({r['reason']})"
    return v


def cell_table(runs: pd.DataFrame, outcome: str, others: tuple[str, ...] = ()) -> pd.DataFrame:
    """Per cell: runs, starts, the mean of its start means of `outcome` with the 95% t interval over starts (and
    of each of `others`, a contrast's own outcome, the mean of start means alone), the floor and collapse shares and
    the realised early per-update KL on the routes the arm acts with."""
    rows = []
    for cell, g in runs.groupby("cell", sort=False):
        iv = start_mean_interval(g[outcome], g["start"])
        row = {"cell": cell, "runs": len(g), "starts": iv.n_starts, outcome: iv.mean, "lo": iv.lo, "hi": iv.hi}
        for other in others:
            row[other] = float(cluster_means(g[other], g["start"]).mean()) if g[other].notna().any() else math.nan
        row.update(
            floor_share=float((g["late_accuracy"] <= 0).mean()),
            collapsed=float(g["collapsed"].mean()),
            kl_acting=float(g["kl_acting"].mean()),
        )
        rows.append(row)
    return pd.DataFrame(rows)


def start_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per start and warm-up (a start's twins warmed on two machines are two rows): its runs, the covariates its
    warm-up recorded (greedy accuracy, sampled reward, the share of prompts with no reward variance among their
    samples, whether it ended in its band; `per_run`) and whether the study admitted it."""
    by = runs.assign(warmup=runs["warmup"].fillna("")).groupby(["start", "warmup"], sort=True)
    table = by[["greedy_accuracy", "sampled_reward", "zero_variance", "in_band"]].first()
    table.insert(0, "runs", by.size())
    table["admitted"] = by["admitted"].all()
    return table.reset_index()


def analyse(study: Study, runs_dir: Path) -> StudyResult:
    """The study's tables and verdicts from its runs under `runs_dir` (read once per process and folder state)."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise FileNotFoundError(f"no runs folder {runs_dir}")
    stamp = max((p.stat().st_mtime_ns for p in runs_dir.glob("*/*/status.json")), default=0)
    return _analysed(study.file.resolve(), runs_dir.resolve(), stamp)


@functools.lru_cache(maxsize=8)
def _analysed(study_file: Path, runs_dir: Path, stamp: int) -> StudyResult:
    """`analyse`, once per declaration, runs folder and state of its runs (`stamp`: their newest status.json)."""
    study = load_study(study_file)
    table = per_run(runs_dir, study.columns, study)
    if study.by_member:  # a pool member's twins (its warm-ups on two machines) are one unit
        table["start"] = [member_start(s, study.member_pool) for s in table["seed"]]
    table["admitted"] = [
        study.admission.admits(r, z, b)
        for r, z, b in zip(table["sampled_reward"], table["zero_variance"], table["in_band"], strict=True)
    ]
    admitted = table[table["admitted"]]
    ran = complete_members(study, table)
    verdicts = correct(study, pd.DataFrame([decide(study, admitted, c, ran) for c in study.contrasts]))
    metas = [run_meta(Path(str(r))) for r in table["run_dir"]]
    outside = [
        str(r) for r, m in zip(table["run_dir"], metas, strict=True) if bool(m.get("compiled")) != study.compiled
    ]
    if outside:
        raise ValueError(
            f"study {study.name} declares every run {'compiled' if study.compiled else 'eager'}, but {len(outside)} "
            f"of its runs ran otherwise (meta.json `compiled`), e.g. {outside[0]}: one study, one numerics domain"
        )
    domains = sorted({f"{m.get('numerics', 'native')}, {'compiled' if m.get('compiled') else 'eager'}" for m in metas})
    provenance = load_provenance(runs_dir)
    return StudyResult(
        table,
        cell_table(admitted, study.outcome, (*study.other_outcomes(), *study.columns)),
        verdicts,
        start_table(table),
        domains,
        provenance_line(provenance),
        secondary_table(
            admitted,
            secondary_contrasts(study),
            lambda runs, weights, column: pair_values(runs, weights, column, study.member_pool),
        ),
        declaration_history(study.file, [Path(str(r)) for r in table["run_dir"]]),
    )


def secondary_contrasts(study: Study) -> dict[str, dict[tuple[str, str], float]]:
    """The contrasts the mission's outcomes are read on: the study's claims and its placebo, or every contrast
    where it declares no claim."""
    placebo = study.match.placebo if study.match else None
    chosen = [c for c in study.contrasts if c.claim != "exploratory" or c.name == placebo] or list(study.contrasts)
    return {c.name: c.weights for c in chosen}


def decided(result: StudyResult) -> bool:
    """Whether every contrast has a verdict no further look can change: reached its boundary, or the last look read.
    A floor, a ceiling or a reference that does not degrade at an earlier look does not stop the study: more
    starts can change the means they are read on. Nor does an unmatched contrast (its realised ratio outside the
    tolerance, or the placebo beyond its margin), whatever its rule alone reads: it has no verdict, and a later look
    reads its ratio and the placebo on more starts (the futility boundary is non-binding, so going on keeps the
    level)."""
    v = result.verdicts
    final = v["final"].astype(bool) if "final" in v else pd.Series(False, index=v.index)
    stopped = v["stopped"].astype(bool) if "stopped" in v else pd.Series(False, index=v.index)
    stopped = stopped & (v["verdict"] != UNMATCHED)
    return bool((stopped | final).all())
