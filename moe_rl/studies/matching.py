"""Divergence matched per start: the probes of a study that declares `match.reference`, the lr each of its runs
gets, and the file that records them.

A study matched by one pilot lr per arm for the whole pool is matched on average at best: a start's early KL at a
given lr is a property of the start (its warm-up), so an arm's ratio to the reference varies from member to member,
and a pilot on a few members misses the pool's mean (`causal_matched`'s dense arm ran at 0.586x the MoE's early
KL). Here each run seed is matched on its own. Before a look's runs, every cell runs **probes**: the run itself,
same cell, same seed, from the member's cached warm-up, stopped after `match.probe_steps` steps (at most
`MAX_PROBE_SHARE` of the run's steps). The reference arm probes at its declared lr, every other arm at each
multiplier of `match.bracket` times its declared lr (the level's lr for the arm's reference model times its
`lr_scale`). A probe's KL is its early per-update KL on the routes it acts with (`kl_acting`,
`moe_rl.analysis.dose.acting_kl_per_run`, over steps 1 .. min(probe_steps, 20)). Per (seed, arm, level), log KL is
fit on log lr by least squares over the arm's probes, and the run goes at the lr where that line reaches
the reference's probe KL on the same seed (the reference's probe is the first steps of its own run: the target is
the reference run's own early KL where probe_steps is the early window). A seed whose own slope is not positive (or
that kept one probe) takes the arm's slope pooled over its seeds at that level (within seed), else the level's over
every matched arm; with none the seed is not matched. A solution outside the bracket is extrapolated up to
`EXTRAPOLATION` times beyond its ends, and clamped there beyond that (status `clamped`: that run is not matched, and
its realised ratio says so).

Where the study declares `match.confirm`, the solved lr is only a centre: each (seed, arm, level) then probes at
each confirm multiplier of it (`confirm_folder`), and its run goes at the lr of whichever of those confirm probes
came nearest the reference's KL in log (status `confirmed` within `match.tolerance`, else `nearest`). A start's early
KL is a noisy function of the lr (a probe at 1.04x the reference's lr differs from the reference's own by an SD of
14-36% in log over members), so a line through three probes places a run only about that well; the chosen probe is
the run's own first steps, so its ratio is the run's realised ratio, known before it runs. The candidates are the
confirm probes alone, all within the confirm multipliers of the line's lr: a bracket probe that happened to land
near the reference's KL far from that lr (an lr the trend says is 3x too high, its first steps low by chance) would
trade a mismatch of the early KL for one of the lr, which acts on every later step.

Where the study declares `match.per: pool`, no seed gets its own lr: the first look's seeds probe the bracket (later
looks probe nothing), and each arm runs every seed at one lr per level (`pooled_lrs`), where the mean over those
seeds of its log KL ratio to the reference's probe on the same seed, a line between the two bracket multipliers it
crosses 0 between, reaches 0. Picking each seed's lr by its own noisy probes matches the probes, not the runs: a
probe chosen because its KL landed near the reference's is low by chance as often as its lr is right, and the run
goes on at that lr (the placebos of every study matched per start ran at 0.83-1.22x the reference's lr, pulled
toward their declared lr, and their differences moved by 7-40 pp per doubling of it). One lr per arm, solved from the
mean over seeds, carries no seed's noise into its runs, and the runs' own early KL, chosen by nothing, reads the
realised ratio. The line is drawn between neighbouring multipliers, not through all of them: an arm's early KL
flattens at high lr, and a line through a wide bracket placed the placebo (the reference itself) at 1.13-1.25x
its own lr in the two dense studies.

The chosen lrs are written to <runs>/<study>/match/lrs.csv (`LRS_COLUMNS`: seed, member, arm, level, the declared and
chosen lr, the probes' multipliers and KLs, the slope and where it came from, the status). A seed's row, once
written, is kept: its run is launched at that lr, and a later look (whose pooled slopes may differ) never moves it,
so a study resumes and reruns at the lrs it ran at.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.studies.design import Study

MAX_PROBE_SHARE = 0.15  # a probe runs at most this share of its run's steps
EXTRAPOLATION = 1.25  # a solved lr may lie up to this factor beyond the bracket's ends; further, it is clamped there
MATCHED = ("interpolated", "extrapolated")  # statuses whose lr is the solution itself
CONFIRMED = ("confirmed", "nearest")  # statuses whose lr is that of the seed's probe nearest the reference's KL
POOLED = ("pooled", "pooled_extrapolated")  # one lr per arm and level (`match.per: pool`), inside or beyond the bracket
LRS_COLUMNS = [
    "seed",
    "member",
    "arm",
    "level",
    "lr_declared",
    "lr",
    "multiplier",
    "kl_reference",
    "probe_multipliers",
    "probe_kls",
    "slope",
    "slope_from",
    "status",
]
_FOLDER = re.compile(r"(?P<arm>[^@]+)@(?P<level>[^@]+)@(?P<kind>[xc])(?P<mult>[0-9.eE+-]+)")


def lr_text(lr: float) -> str:
    """An lr as the launcher writes it (`optim.lr=` on the command line, the run folder's name)."""
    return f"{lr:.6g}"


def declared_lr(study: Study, arm: str, level: str) -> float:
    """The lr a cell runs at as declared: its level's lr for the arm's reference model times the arm's `lr_scale`,
    as `Study.cell_overrides` writes it."""
    a, lv = study.arms[arm], study.levels[level]
    if str(a.ref) not in lv.lr:
        raise ValueError(f"study {study.name}: level {level} sets no lr for {arm}'s reference model {a.ref!r}")
    return float(lr_text(lv.lr[str(a.ref)] * a.lr_scale))


def multipliers(study: Study, arm: str) -> tuple[float, ...]:
    """The multipliers of its declared lr an arm probes at: the reference 1 alone, every other arm the bracket."""
    assert study.match is not None and study.match.reference is not None
    return (1.0,) if arm == study.match.reference else study.match.bracket


def probe_lr(study: Study, arm: str, level: str, multiplier: float) -> float:
    return float(lr_text(declared_lr(study, arm, level) * multiplier))


def probe_cells(study: Study) -> list[tuple[str, str, float]]:
    """(arm, level, multiplier) of every probe multirun, in the study's cell order (the reference's first at each
    level, so its members' warm-ups are built by the first probes)."""
    assert study.match is not None and study.match.reference is not None
    ref = study.match.reference
    cells = sorted(study.cells(), key=lambda c: c[0] != ref)
    return [(a, lv, m) for a, lv in cells for m in multipliers(study, a)]


def probe_folder(arm: str, level: str, multiplier: float) -> str:
    """The folder of a probe multirun under <runs>/<study>/probes/: `arm@level@x<multiplier>`."""
    return f"{arm}@{level}@x{multiplier:g}"


def confirm_folder(arm: str, level: str, multiplier: float) -> str:
    """The folder of a cell's confirm probes at one multiplier of each seed's solved lr: `arm@level@c<multiplier>`
    (each seed at its own lr)."""
    return f"{arm}@{level}@c{multiplier:g}"


def parse_folder(name: str) -> tuple[str, str, float, bool] | None:
    """(arm, level, multiplier, confirm) of a probe folder: a bracket probe's (`probe_folder`, confirm False) or a
    confirm probe's (`confirm_folder`, True); None for any other name."""
    m = _FOLDER.fullmatch(name)
    return None if m is None else (m["arm"], m["level"], float(m["mult"]), m["kind"] == "c")


def with_override(overrides: list[str], key: str, value: object) -> list[str]:
    """`overrides` with `key=value` in place of every `key=...` (appended where there is none)."""
    out = [o for o in overrides if o.partition("=")[0] != key]
    return [*out, f"{key}={value}"]


def probe_share(probe_steps: int, steps: int) -> float:
    """A probe's steps as a share of its run's."""
    return probe_steps / steps


def check_probe_cost(probe_steps: int, steps: int, cell: str) -> float:
    """The probe's share of its run's steps; a ValueError where it exceeds `MAX_PROBE_SHARE`."""
    share = probe_share(probe_steps, steps)
    if share > MAX_PROBE_SHARE + 1e-12:
        raise ValueError(
            f"{cell}: a probe of {probe_steps} steps is {share:.0%} of its run's {steps}; a probe may cost at most "
            f"{MAX_PROBE_SHARE:.0%} of a run (lower match.probe_steps to {int(MAX_PROBE_SHARE * steps)} or fewer)"
        )
    return share


def probes_per_seed(study: Study) -> dict[str, int]:
    """Per level, how many probes a run seed takes: one for the reference, the bracket and the confirm multipliers
    for each other arm."""
    assert study.match is not None
    out: dict[str, int] = {}
    for _, level, _ in probe_cells(study):
        out[level] = out.get(level, 0) + 1
    for _, level in matched_cells(study):
        out[level] = out.get(level, 0) + len(study.match.confirm)
    return out


def read_probes(folder: Path, study: Study) -> pd.DataFrame:
    """Every finished probe under `folder`/<arm>@<level>@x<m>/ (`probe_folder`) and <arm>@<level>@c<m>/
    (`confirm_folder`): seed, member, arm, level, multiplier (of the cell's declared lr), lr (as launched), kl (its
    early acting KL; NaN where it logged none), status, wall_s, run_dir, confirm (whether a confirm probe)."""
    from moe_rl.analysis.dose import acting_kl_per_run
    from moe_rl.analysis.load import INCOMPLETE_STATUSES, load_results, run_lr, runs
    from moe_rl.analysis.power import run_wall_s
    from moe_rl.metrics.names import KL_UPDATE_K3, KL_UPDATE_K3_ACTING

    columns = ["seed", "member", "arm", "level", "multiplier", "lr", "kl", "status", "wall_s", "run_dir", "confirm"]
    frames = []
    for cell in sorted(p for p in Path(folder).glob("*@*@*") if p.is_dir()):
        parsed = parse_folder(cell.name)
        if parsed is None or not any(cell.rglob("metrics.parquet")):
            continue
        arm, level, mult, confirm = parsed
        df = load_results(cell, keys=[KL_UPDATE_K3, KL_UPDATE_K3_ACTING])
        if df.empty:
            continue
        table = runs(df).set_index("run")
        table = table[~table["status"].isin(INCOMPLETE_STATUSES)]
        kl = acting_kl_per_run(df) if (df["key"] == KL_UPDATE_K3).any() else pd.Series(dtype=float)
        known = arm in study.arms and level in study.levels
        if not confirm:
            lr: object = probe_lr(study, arm, level, mult) if known else np.nan
            mults: object = mult
        else:  # each seed at its own lr: as its run launched it
            lr = np.array([run_lr(Path(str(r))) for r in table["run_dir"]], dtype=float)
            mults = lr / declared_lr(study, arm, level) if known else np.nan
        frames.append(
            pd.DataFrame(
                {
                    "seed": table["seed"].astype(int).to_numpy(),
                    "arm": arm,
                    "level": level,
                    "multiplier": mults,
                    "lr": lr,
                    "kl": kl.reindex(table.index).to_numpy(float),
                    "status": table["status"].to_numpy(),
                    "wall_s": [run_wall_s(Path(str(r))) for r in table["run_dir"]],
                    "run_dir": table["run_dir"].to_numpy(),
                    "confirm": confirm,
                }
            )
        )
    if not frames:
        return pd.DataFrame(columns=columns)
    out = pd.concat(frames, ignore_index=True)
    out["member"] = out["seed"] % study.member_pool
    return out[columns].sort_values(["level", "arm", "seed", "multiplier"], ignore_index=True)


def solve_lrs(
    probes: pd.DataFrame,
    reference: str,
    bracket: tuple[float, ...],
    declared: dict[tuple[str, str], float],
    pool: int,
    extrapolation: float = EXTRAPOLATION,
) -> pd.DataFrame:
    """The lr each (seed, arm, level) of `declared` (every matched cell: its declared lr; the reference's cells are
    left out) runs at, from `probes` (columns seed, arm, level, multiplier, lr, kl; see the module docstring).
    Every seed some probe of the cell or of the reference at its level names gets a row (`LRS_COLUMNS`); where it
    cannot be matched (`status` "no reference probe", "no probe KL", "no slope") its lr is NaN."""
    keys = ["arm", "level", "seed"]
    probes = probes.astype({"seed": int, "multiplier": float, "lr": float, "kl": float})
    ok = probes[np.isfinite(probes["kl"]) & (probes["kl"] > 0)].assign(
        x=lambda f: np.log(f["lr"]), y=lambda f: np.log(f["kl"])
    )
    refs = ok[ok["arm"] == reference].groupby(["level", "seed"])["y"].mean()
    cells = pd.DataFrame(
        [(a, lv, lr) for (a, lv), lr in declared.items() if a != reference], columns=["arm", "level", "lr_declared"]
    )
    named = probes[["arm", "level", "seed"]].drop_duplicates()
    ref_seeds = named[named["arm"] == reference].drop(columns="arm")
    own = named[named["arm"] != reference]
    seeds = pd.concat([cells.merge(ref_seeds, on="level"), cells.merge(own, on=["arm", "level"])]).drop_duplicates(keys)
    out = seeds.sort_values(["level", "arm", "seed"], ignore_index=True)
    out["member"] = out["seed"] % pool
    out["log_ref"] = pd.MultiIndex.from_frame(out[["level", "seed"]]).map(refs.to_dict()).astype(float)
    matched = ok[ok["arm"] != reference]
    stats = matched.groupby(keys).agg(
        n=("x", "size"),
        mx=("x", "mean"),
        my=("y", "mean"),
        probe_multipliers=("multiplier", lambda v: ";".join(f"{m:g}" for m in v)),
        probe_kls=("kl", lambda v: ";".join(f"{k:.6g}" for k in v)),
    )
    if len(stats):
        centred = matched.join(stats[["mx", "my"]], on=keys)
        dx, dy = centred["x"] - centred["mx"], centred["y"] - centred["my"]
        sums = pd.DataFrame({"sxx": dx**2, "sxy": dx * dy}).groupby([centred[k] for k in keys]).sum()
        stats = stats.join(sums)
        stats["own"] = np.where(stats["sxx"] > 0, stats["sxy"] / stats["sxx"].where(stats["sxx"] > 0), np.nan)
        arm_slope = sums.groupby(["arm", "level"]).sum()
        arm_slope = (arm_slope["sxy"] / arm_slope["sxx"].where(arm_slope["sxx"] > 0)).rename("arm_slope")
        level_slope = sums.groupby("level").sum()
        level_slope = (level_slope["sxy"] / level_slope["sxx"].where(level_slope["sxx"] > 0)).rename("level_slope")
        stats = stats.join(arm_slope, on=["arm", "level"]).join(level_slope, on="level")
    else:
        stats = stats.assign(own=np.nan, arm_slope=np.nan, level_slope=np.nan)
    out = out.join(
        stats[["n", "mx", "my", "probe_multipliers", "probe_kls", "own", "arm_slope", "level_slope"]], on=keys
    )
    out["probe_multipliers"] = out["probe_multipliers"].fillna("")
    out["probe_kls"] = out["probe_kls"].fillna("")
    slope, source = np.full(len(out), np.nan), np.full(len(out), "", dtype=object)
    for column, name in (("level_slope", "level"), ("arm_slope", "arm"), ("own", "own")):  # the last positive wins
        usable = (out[column] > 0).to_numpy()
        slope[usable], source[usable] = out.loc[usable, column], name
    out["slope"], out["slope_from"] = slope, source
    # the line through the seed's own probes' centre, at its slope: with its own slope, its least-squares line
    log_lr = out["mx"] + (out["log_ref"] - out["my"]) / out["slope"]
    mult = np.exp(log_lr) / out["lr_declared"]
    lo, hi = min(bracket) / extrapolation, max(bracket) * extrapolation
    status = np.where((mult >= min(bracket)) & (mult <= max(bracket)), "interpolated", "extrapolated")
    status = np.where((mult < lo) | (mult > hi), "clamped", status)
    out["multiplier"] = mult.clip(lo, hi)
    out["status"] = np.select(
        [out["log_ref"].isna(), out["n"].isna(), ~(out["slope"] > 0)],
        ["no reference probe", "no probe KL", "no slope"],
        status,
    )
    unmatched = ~out["status"].isin(MATCHED + ("clamped",))
    out.loc[unmatched, ["multiplier", "slope"]] = np.nan
    out.loc[unmatched, "slope_from"] = ""
    out["lr"] = [
        float(lr_text(d * m)) if np.isfinite(m) else math.nan
        for d, m in zip(out["lr_declared"], out["multiplier"], strict=True)
    ]
    out["kl_reference"] = np.exp(out["log_ref"])
    return out[LRS_COLUMNS].reset_index(drop=True)


def confirm_probes(solved: pd.DataFrame, confirm: tuple[float, ...]) -> pd.DataFrame:
    """The confirm probes the solved rows (`solve_lrs`) with an lr ask for: seed, arm, level, multiplier (of the
    solved lr) and lr, as launched."""
    rows = [
        (int(r.seed), str(r.arm), str(r.level), c, float(lr_text(float(r.lr) * c)))
        for r in solved[solved["lr"].notna()].itertuples()
        for c in confirm
    ]
    return pd.DataFrame(rows, columns=["seed", "arm", "level", "multiplier", "lr"])


def nearest_lrs(solved: pd.DataFrame, probes: pd.DataFrame, confirm: int, tolerance: float) -> pd.DataFrame:
    """`solved` (`solve_lrs`) with each row's lr that of the seed's confirm probe of the cell (`probes` as
    `read_probes` reads them) whose KL came nearest the reference's in log: status `confirmed` within `tolerance`,
    `nearest` beyond it; `probe_multipliers` and `probe_kls` then list the bracket's probes and the confirm probes.
    A row with fewer than `confirm` confirm probes finished (or none with a KL) keeps no lr (status `unconfirmed`),
    so a later call retries it; one that was not solved stays as it was."""
    keys = ["seed", "arm", "level"]
    out = solved.copy()
    found = probes.astype({"seed": int, "lr": float, "kl": float})
    counts = found[found["confirm"].astype(bool)].groupby(keys).size()
    listed = found.sort_values([*keys, "lr"])
    listed = {k: g for k, g in listed[np.isfinite(listed["kl"])].groupby(keys)}
    found = found[found["confirm"].astype(bool) & np.isfinite(found["kl"]) & (found["kl"] > 0)]
    found = found.sort_values([*keys, "lr"])
    groups = {k: g for k, g in found.groupby(keys)}
    for i, row in out.iterrows():
        if not np.isfinite(row["lr"]):
            continue
        key = (int(row["seed"]), str(row["arm"]), str(row["level"]))
        cands = groups.get(key)
        if counts.get(key, 0) < confirm or cands is None:
            out.loc[i, ["lr", "multiplier", "slope"]] = np.nan
            out.loc[i, ["slope_from", "status"]] = ["", "unconfirmed"]
            continue
        gap = np.abs(np.log(cands["kl"].to_numpy()) - math.log(row["kl_reference"]))
        best = cands.iloc[int(np.argmin(gap))]
        out.loc[i, "lr"] = float(best["lr"])
        out.loc[i, "multiplier"] = float(best["lr"]) / row["lr_declared"]
        out.loc[i, "status"] = "confirmed" if gap.min() <= math.log(tolerance) + 1e-12 else "nearest"
        every = listed[key]
        out.loc[i, "probe_multipliers"] = ";".join(f"{m:.6g}" for m in every["lr"].to_numpy() / row["lr_declared"])
        out.loc[i, "probe_kls"] = ";".join(f"{k:.6g}" for k in every["kl"])
    return out


def pooled_lrs(
    probes: pd.DataFrame,
    reference: str,
    bracket: tuple[float, ...],
    declared: dict[tuple[str, str], float],
    probed: dict[tuple[str, str], list[int]],
    seeds: dict[tuple[str, str], list[int]],
    pool: int,
    extrapolation: float = EXTRAPOLATION,
) -> pd.DataFrame:
    """One lr per matched cell of `declared` (its declared lr) for every seed of `seeds[cell]`, from the probes
    (columns seed, arm, level, multiplier, lr, kl) at the `bracket`'s multipliers of the seeds `probed[cell]` names:
    per multiplier, the mean over those seeds of log(KL) minus the log KL of the reference's probe on the same seed;
    the lr where the line between the two neighbouring multipliers whose means bracket 0 crosses it (the lowest such
    pair), status `pooled`; where every mean lies on one side, the nearest end pair's line, status
    `pooled_extrapolated` (up to `extrapolation` beyond the bracket's end, `clamped` there beyond it). Rows
    `LRS_COLUMNS`; `slope` is that line's slope, `kl_reference` and the probe columns the seed's own where it was
    probed. Until every probed seed has a finished probe of the reference and at every multiplier, the cell's rows
    keep no lr (status `probes missing`), so a later call solves it on the same seeds; a seed whose finished probes
    read no finite, positive KL is left out of the means (fewer than 2 seeds left: `no probe KL`)."""
    probes = probes.astype({"seed": int, "multiplier": float, "lr": float, "kl": float})
    probes = probes.assign(
        multiplier=[next((b for b in bracket if math.isclose(m, b)), m) for m in probes["multiplier"]]
    )
    good = np.isfinite(probes["kl"]) & (probes["kl"] > 0)
    ok = probes[good]
    refs = ok[ok["arm"] == reference].groupby(["level", "seed"])["kl"].apply(lambda v: float(np.log(v).mean()))
    rows = []
    for (arm, level), lr_declared in declared.items():
        if arm == reference:
            continue
        at_level = probes[probes["level"] == level]
        ran = at_level[at_level["arm"] == arm].groupby("seed")["multiplier"].agg(set)  # finished, with a KL or not
        ref_ran = set(at_level.loc[at_level["arm"] == reference, "seed"])
        table = ok[(ok["arm"] == arm) & (ok["level"] == level)].pivot_table(
            index="seed", columns="multiplier", values="kl", aggfunc="first"
        )
        table = table.reindex(columns=list(bracket))
        want = probed.get((arm, level), [])
        finished = {s for s in want if s in ref_ran and s in ran.index and ran[s] >= set(bracket)}
        use = [s for s in want if (level, s) in refs.index and s in table.index and table.loc[s].notna().all()]
        lr, mult, slope = math.nan, math.nan, math.nan
        status = "probes missing" if not want or len(finished) < len(want) else "no probe KL"
        if status == "no probe KL" and len(use) >= 2:
            ref = np.array([refs[(level, s)] for s in use])
            means = np.array([float(np.mean(np.log(table.loc[use, m].to_numpy(float)) - ref)) for m in bracket])
            x = np.log(np.array(bracket))
            cross = [i for i in range(len(x) - 1) if means[i] <= 0 <= means[i + 1]]
            i = cross[0] if cross else (0 if means[0] > 0 else len(x) - 2)
            slope = (means[i + 1] - means[i]) / (x[i + 1] - x[i])
            if slope > 0:
                mult = math.exp(x[i] - means[i] / slope)
                lo, hi = bracket[0] / extrapolation, bracket[-1] * extrapolation
                status = "pooled" if cross else "pooled_extrapolated"
                if not lo <= mult <= hi:
                    mult, status = min(max(mult, lo), hi), "clamped"
                lr = float(lr_text(lr_declared * mult))
            else:
                status = "no slope"
        for seed in seeds.get((arm, level), []):
            own = table.loc[seed] if seed in table.index else None
            rows.append(
                {
                    "seed": seed,
                    "member": seed % pool,
                    "arm": arm,
                    "level": level,
                    "lr_declared": lr_declared,
                    "lr": lr,
                    "multiplier": lr / lr_declared if np.isfinite(lr) else math.nan,
                    "kl_reference": math.exp(refs[(level, seed)]) if (level, seed) in refs.index else math.nan,
                    "probe_multipliers": "" if own is None else ";".join(f"{m:g}" for m in own.dropna().index),
                    "probe_kls": "" if own is None else ";".join(f"{k:.6g}" for k in own.dropna()),
                    "slope": slope if np.isfinite(lr) else math.nan,
                    "slope_from": "pool" if np.isfinite(lr) else "",
                    "status": status,
                }
            )
    return pd.DataFrame(rows, columns=LRS_COLUMNS)


def bracket_probes(probes: pd.DataFrame) -> pd.DataFrame:
    """The bracket's probes of `probes` (`read_probes`), the confirm probes left out."""
    return probes[~probes["confirm"].astype(bool)] if "confirm" in probes else probes


def solved_lrs(study: Study, probes: pd.DataFrame) -> pd.DataFrame:
    """`solve_lrs` for `study`'s matched cells from its bracket probes alone (a confirm probe does not move the
    solution, so a resumed look asks for the confirm probes it launched before)."""
    assert study.match is not None and study.match.reference is not None
    return solve_lrs(
        bracket_probes(probes), study.match.reference, study.match.bracket, matched_cells(study), study.member_pool
    )


def matched_cells(study: Study) -> dict[tuple[str, str], float]:
    """Every cell matched to the reference (all but the reference's own), with its declared lr."""
    assert study.match is not None and study.match.reference is not None
    return {(a, lv): declared_lr(study, a, lv) for a, lv in study.cells() if a != study.match.reference}


def probe_starts(study: Study, starts: int) -> int:
    """How many of a look's `starts` probe: all of them, or with `match.per: pool` those of the first look alone."""
    assert study.match is not None
    return min(starts, study.design.looks[0]) if study.match.pooled else starts


def study_pooled_lrs(study: Study, probes: pd.DataFrame, starts: int, kept: pd.DataFrame | None) -> pd.DataFrame:
    """`pooled_lrs` for `study`'s matched cells over the seeds of its first `starts` members, solved on the first
    look's seeds; a cell `kept` already holds an lr for (as written before) gives its later seeds that lr."""
    assert study.match is not None and study.match.reference is not None
    cells = matched_cells(study)
    first = study.design.looks[0]
    probed = {c: study.seeds(min(starts, first), c) for c in cells}
    new = pooled_lrs(
        bracket_probes(probes),
        study.match.reference,
        study.match.bracket,
        cells,
        probed,
        {c: study.seeds(starts, c) for c in cells},
        study.member_pool,
    )
    if kept is None or kept.empty:
        return new
    for (arm, level), rows in kept[kept["lr"].notna()].groupby(["arm", "level"]):
        if rows["lr"].nunique() != 1:
            raise ValueError(
                f"{study.name}: match/lrs.csv holds {rows['lr'].nunique()} lrs for {arm}@{level}, "
                "where `match.per: pool` runs one (was it written per start?)"
            )
        old = rows.iloc[0]
        later = (new["arm"] == arm) & (new["level"] == level)
        for col in ("lr", "multiplier", "slope", "slope_from", "status"):
            new.loc[later, col] = old[col]
    return new


def study_lrs(
    study: Study, probes: pd.DataFrame, kept: pd.DataFrame | None = None, starts: int | None = None
) -> pd.DataFrame:
    """`solve_lrs` for `study`'s matched cells (then `nearest_lrs` where it declares `match.confirm`; with
    `match.per: pool`, `study_pooled_lrs` over the first `starts` members), with each (seed, arm, level) `kept`
    already holds (a matched lr, as written before) kept as it was; rows that could not be matched are not kept, so
    a later call retries them."""
    assert study.match is not None and study.match.reference is not None
    if study.match.pooled:
        new = study_pooled_lrs(study, probes, study.design.looks[-1] if starts is None else starts, kept)
    else:
        new = solved_lrs(study, probes)
    if study.match.confirm:
        new = nearest_lrs(new, probes, len(study.match.confirm), study.match.tolerance)
    if kept is None or kept.empty:
        return new
    kept = kept[kept["lr"].notna()]
    keys = ["seed", "arm", "level"]
    old = pd.MultiIndex.from_frame(kept[keys])
    new = new[~pd.MultiIndex.from_frame(new[keys]).isin(old)]
    return pd.concat([kept[LRS_COLUMNS], new], ignore_index=True).sort_values(
        ["level", "arm", "seed"], ignore_index=True
    )


def lrs_path(runs: Path, study: Study) -> Path:
    return Path(runs) / study.name / "match" / "lrs.csv"


def read_lrs(path: Path) -> pd.DataFrame | None:
    """The lrs a study chose so far (None: none written yet)."""
    if not Path(path).is_file():
        return None
    frame = pd.read_csv(path, keep_default_na=True, dtype={"probe_multipliers": str, "probe_kls": str})
    return frame.astype({"seed": int, "member": int, "arm": str, "level": str})


def write_lrs(frame: pd.DataFrame, path: Path) -> None:
    """Write the matched rows (those with an lr): a seed not matched yet is left for the next call."""
    from moe_rl.run.atomic import write_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, frame[frame["lr"].notna()][LRS_COLUMNS].to_csv(index=False, float_format="%.6g"))


def seed_lrs(lrs: pd.DataFrame, arm: str, level: str, seeds: list[int]) -> dict[int, float]:
    """The chosen lr of each of `seeds` of a cell that has one."""
    cell = lrs[(lrs["arm"] == arm) & (lrs["level"] == level) & lrs["lr"].notna()]
    chosen = dict(zip(cell["seed"].astype(int), cell["lr"].astype(float), strict=True))
    return {s: chosen[s] for s in seeds if s in chosen}


def pooled_reading(study: Study, lrs: pd.DataFrame) -> pd.DataFrame:
    """What one lr per arm would have been for a study matched per start: `pooled_lrs` on the bracket probes its
    match/lrs.csv lists (each seed's probes at the bracket's multipliers, its reference's KL), over every seed with all
    of them. Per matched cell: `n` seeds, `pooled` the pool's lr and `ran` the geometric mean of the lrs its seeds
    ran at, both as multiples of the reference's lr, and the pool's `status`."""
    assert study.match is not None and study.match.reference is not None
    ref, bracket = study.match.reference, study.match.bracket
    rows = []
    for r in lrs[lrs["lr"].notna()].itertuples():
        rows.append((int(r.seed), ref, str(r.level), 1.0, math.nan, float(r.kl_reference)))
        mults = [float(m) for m in str(r.probe_multipliers).split(";") if m]
        kls = [float(k) for k in str(r.probe_kls).split(";") if k]
        for m, kl in zip(mults, kls, strict=True):
            b = next((b for b in bracket if math.isclose(m, b, rel_tol=1e-4)), None)
            if b is not None:
                rows.append((int(r.seed), str(r.arm), str(r.level), b, float(r.lr_declared) * b, kl))
    probes = pd.DataFrame(rows, columns=["seed", "arm", "level", "multiplier", "lr", "kl"]).drop_duplicates()
    # a confirm probe that landed on a bracket multiplier makes that point ambiguous: leave it out
    probes = probes.drop_duplicates(["seed", "arm", "level", "multiplier"], keep=False)
    out = []
    for (arm, level), cell in lrs[lrs["lr"].notna()].groupby(["arm", "level"]):
        have = probes[(probes["arm"] == arm) & (probes["level"] == level)].groupby("seed")["multiplier"].nunique()
        seeds = sorted(int(s) for s in have[have == len(bracket)].index)
        key = (str(arm), str(level))
        declared = {key: float(cell["lr_declared"].iloc[0])}
        solved = pooled_lrs(probes, ref, bracket, declared, {key: seeds}, {key: seeds[:1]}, 1)
        ref_lr = declared_lr(study, ref, str(level))
        lr = float(solved["lr"].iloc[0]) if len(solved) else math.nan
        ran = float(np.exp(np.log(cell["lr"].astype(float)).mean()))
        status = str(solved["status"].iloc[0]) if len(solved) else "no probes"
        out.append((arm, level, len(seeds), lr / ref_lr, ran / ref_lr, status))
    return pd.DataFrame(out, columns=["arm", "level", "n", "pooled", "ran", "status"])


def placebo_lr(study: Study, runs: pd.DataFrame, lrs: pd.DataFrame) -> dict[str, float] | None:
    """What the placebo's matched lr did to its outcome. The placebo is the reference's model and method brought to
    the reference's early KL like any arm, so per start it runs at its own multiple of the reference's lr; over the
    starts with both runs admitted, its outcome difference (placebo - reference, `study.outcome`) regressed on log2
    of that multiple: `n` starts, `ratio` the median multiple, `slope` the change per doubling with its 95% t
    interval (`lo`, `hi`; NaN where every start ran at one lr). A slope below 0: at equal early KL a higher lr still
    ends lower, so any matched arm that ran at another lr than its model's carries that too. None where the study
    has no placebo matched per start or fewer than 3 such starts."""
    m = study.match
    if m is None or m.reference is None or m.placebo is None:
        return None
    contrast = next(c for c in study.contrasts if c.name == m.placebo)
    (arm, level) = next(cell for cell, w in contrast.weights.items() if w > 0)
    ref_lr = declared_lr(study, m.reference, level)
    chosen = lrs[(lrs["arm"] == arm) & (lrs["level"] == level) & lrs["lr"].notna()].set_index("member")["lr"]
    admitted = runs[runs["admitted"].astype(bool) & (runs["level"] == level)]
    admitted = admitted.assign(member=admitted["seed"].astype(int) % study.member_pool)
    outcome = admitted.pivot_table(index="member", columns="arm", values=study.outcome, aggfunc="mean")
    if arm not in outcome or m.reference not in outcome:
        return None
    diff = (outcome[arm] - outcome[m.reference]).dropna()
    diff = diff[diff.index.isin(chosen.index)]
    if len(diff) < 3:
        return None
    x = np.log2(chosen.loc[diff.index].to_numpy(float) / ref_lr)
    y = diff.to_numpy(float)
    if np.ptp(x) == 0:  # one lr for every start (`match.per: pool`): nothing to regress on
        nan = math.nan
        return {"n": float(len(y)), "ratio": float(np.exp2(x[0])), "slope": nan, "lo": nan, "hi": nan}
    from scipy import stats

    fit = stats.linregress(x, y)
    half = float(stats.t.ppf(0.975, len(y) - 2) * fit.stderr)
    return {
        "n": float(len(y)),
        "ratio": float(np.exp2(np.median(x))),
        "slope": float(fit.slope),
        "lo": float(fit.slope) - half,
        "hi": float(fit.slope) + half,
    }
