"""Paired claims: one arm predicted to beat another on seed-paired runs, declared as a `PairedClaim` and
judged by `judge_paired`.

A record names the runs (`experiment`, its filter `runs`), how they pair (`pairing`, and the seed), which
cells count (those where the `degrading` arms end below their cold start: a stability claim needs cells where
training breaks), the outcomes and so the test (`outcomes`), the direction (`better` is predicted to beat
`worse`), what must not happen beside it (`rivals` that must not beat the claimed arm, `holds_start`: the
better arm must not itself end below its cold start), the margins and the words of the page. The looks at the
data come from the experiment's preset (its `analysis` block and the extensions added after a look,
`preset_analyses`), as do the outcomes and claims it declares, which the page checks against the record. One engine
turns a record into a CLAIMS.md row: the same steps, texts and corrections for every paired claim.

Seeds are not the unit of replication: runs that share a cold start share its weights. The engine counts the
independent cold starts behind the compared arms' runs (`cells.independent_starts`); with fewer than MIN_UNITS
(`moe_rl.analysis.clustered`) the row is descriptive: inconclusive, the seed-level reading (the grid of
collapse definitions included) kept in its reason and notes, its statistic and paragraph kept and marked so.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.claims.arms import (
    Comparison,
    compare_arms,
    comparison_plain,
    comparison_text,
    counts_note,
    pair_runs,
    pair_starts,
)
from moe_rl.analysis.claims.cells import (
    all_runs,
    cell_list,
    independent_starts,
    phase_cells,
    phase_outcomes,
    runs_in_cells,
)
from moe_rl.analysis.claims.pooled import compare_collapse, kappa_by_cell
from moe_rl.analysis.claims.preset_analyses import Declared, extension_of, looks_note
from moe_rl.analysis.claims.rules import (
    ACCURACY,
    ALPHA,
    INCONCLUSIVE,
    INTERVAL,
    MARGINS,
    N_BOOT,
    NO_DATA,
    NOT_REPRODUCED,
    PRIMARY,
    REPRODUCED,
    UNTESTABLE_HERE,
    Claim,
    accuracy_points,
    descriptive,
    descriptive_plain,
    fmt_p,
    set_robustness,
    would_change,
)
from moe_rl.analysis.clustered import descriptive_reason, pair_keys
from moe_rl.analysis.collapse_definitions import ALTERNATIVE_DEFINITION, MAIN_DEFINITION
from moe_rl.analysis.phase import cell_label
from moe_rl.analysis.stats import compare_pairs, holm, looks_adjusted

ARMS_OUTCOMES = tuple(PRIMARY)  # final accuracy, reward AUC, time to collapse: `compare_arms`
COLLAPSE_OUTCOMES = (ACCURACY, "collapse")  # final accuracy and collapse pooled over cells (exact CMH)
ARMS_TEST = "paired sign-flip (accuracy, reward AUC), log-rank on pairs (time to collapse); Holm"
OWN_START_WORDS = {
    "accuracy": "accuracy change",
    "auc_name": "reward AUC above the start reward",
    "qualifier": ", each from its own start",
}


@dataclass(frozen=True)
class AlsoOn:
    """The same judgement on another experiment's runs, alone or pooled with the claim's own (pairs never
    cross experiments' families: each has its own cold start), written as a note beside the verdict.

    `note` is a template with the fields {verdict}, {reason}, {statistic}, {test} and {families} (the model
    families of the claim's own runs); a "; "-separated part whose field is empty is left out."""

    experiment: str
    note: str
    pooled: bool = False


@dataclass(frozen=True)
class PairedClaim:
    """A claim that `better` beats `worse` on runs paired by cell and seed; every field but the first five
    has a default, so a new claim names its arms and its experiment and says only where it differs."""

    id: int
    claim: str
    source: str
    rule: str  # the verdict rule as the page states it
    experiment: str  # the result folder, and the preset whose `analysis` block declares its looks
    worse: str = ""
    better: str = ""  # predicted to beat `worse`
    rivals: tuple[tuple[str, str], ...] = ()  # (worse, better) comparisons that must not come out reproduced
    holds_start: str = ""  # words naming `better` where it must not end below its own cold start ("" not asked)
    outcomes: tuple[str, ...] = ARMS_OUTCOMES  # ARMS_OUTCOMES or COLLAPSE_OUTCOMES: which test decides
    margins: Mapping[str, float] = field(default_factory=lambda: dict(MARGINS))  # outcome -> too small to matter
    runs: Callable[[pd.DataFrame], pd.DataFrame] = all_runs  # which runs of the experiment count
    pairing: tuple[str, ...] | None = None  # cell keys runs pair on besides the seed; None: the phase map's cells
    degrading: tuple[str, ...] = ()  # arms whose mean accuracy must end below the cold start's; (): both compared
    compare_by: str = "arm"  # the run column holding the compared arms; another moves `arm` to `algo_arm`
    from_own_start: bool = False  # accuracy and reward AUC from each run's own start (arms with own cold starts)
    names: Mapping[str, str] = field(default_factory=dict)  # arm -> short name in reasons and test text
    label: str = "{better} vs {worse}"  # the predicted comparison in a reason that has several parts
    test: str = ""  # the test column; "" words the outcomes' test
    cells_text: str = ""  # "{n}" and "{cells}"; "" names the degrading arms
    agreement: bool = False  # note how the two collapse definitions agree per cell
    also: tuple[AlsoOn, ...] = ()
    plain: str = ""  # the paragraph for a person as a template; "" the outcomes' own (or the page's fallback)
    describe: Callable[[Path], list[str]] | None = None  # notes of the claim's own, measured, not tested
    no_data: tuple[str, str] = (INCONCLUSIVE, NO_DATA)  # verdict and reason ({experiment})
    no_arms: tuple[str, str] = (INCONCLUSIVE, "no runs of {missing} in {experiment}")
    no_cell: tuple[str, str] = (
        UNTESTABLE_HERE,
        "{degrading} end above their cold start's accuracy in every cell ({tested})",
    )

    def __post_init__(self) -> None:
        if self.outcomes not in TESTS:
            raise ValueError(f"claim {self.id}: outcomes {self.outcomes} are none of {sorted(TESTS)}")
        if not (self.worse and self.better):
            raise ValueError(f"claim {self.id}: name the compared arms (worse, better)")
        if self.holds_start and not self.from_own_start:
            raise ValueError(f"claim {self.id}: holds_start measures from each run's own start (from_own_start)")
        if self.agreement and self.outcomes != ARMS_OUTCOMES:
            raise ValueError(f"claim {self.id}: agreement notes need the outcomes {ARMS_OUTCOMES}")

    @property
    def arms(self) -> list[str]:
        """Every arm the claim compares, sorted."""
        return sorted({self.worse, self.better, *(a for pair in self.rivals for a in pair)})

    @property
    def grid(self) -> bool:
        """Whether the outcomes depend on the definition of collapse (so the grid of definitions is loaded)."""
        return self.outcomes == ARMS_OUTCOMES

    def name(self, arm: str) -> str:
        return self.names.get(arm, arm)


@dataclass
class Result:
    """One comparison of `better` with `worse` by the record's test."""

    worse: str
    better: str
    verdict: str
    reason: str
    p: float
    statistic: str
    test: str
    grid: dict[str, tuple[str, str]]  # collapse definition -> (verdict, counts-only verdict); {} where none
    notes: list[str]
    accuracy: dict[str, float]  # final accuracy (ACCURACY), better - worse over pairs: `paired_compare`
    comparison: Comparison | None = None  # the arms test's measurements


@dataclass
class Decision:
    """A record's verdict on one set of runs, before the grid of collapse definitions is consulted."""

    verdict: str
    reason: str
    sel: pd.DataFrame  # the runs in the cells that count
    results: list[Result] = field(default_factory=list)  # the predicted comparison, then the rivals
    start: dict[str, dict] = field(default_factory=dict)  # arm -> its change from its own cold start
    grid: dict[str, tuple[str, str]] = field(default_factory=dict)
    tested: str = ""  # the cells looked at, where none counts
    starts: int = 0  # the independent cold starts behind the compared arms' runs in `sel` (`independent_starts`)


# --- the two tests: measured outcomes paired by seed, or collapse pooled over cells ------------------


def arms_result(
    sel: pd.DataFrame, worse: str, better: str, cells: list[str], looks: int, record: PairedClaim
) -> Result:
    """`compare_arms`: final accuracy, reward AUC and time to collapse, Holm over the three."""
    cmp = compare_arms(sel, worse, better, cells, looks=looks, margins=record.margins)
    words = OWN_START_WORDS if record.from_own_start else {}
    return Result(
        worse,
        better,
        cmp.verdict,
        cmp.reason,
        cmp.p,
        comparison_text(cmp, **words),
        ARMS_TEST + (f", x {looks} looks" if looks > 1 else ""),
        dict(cmp.grid),
        [counts_note(cmp)],
        cmp.cont[ACCURACY],
        cmp,
    )


def collapse_result(
    sel: pd.DataFrame, worse: str, better: str, cells: list[str], looks: int, record: PairedClaim
) -> Result:
    """Collapse under the main definition pooled over cells (exact CMH, one-sided) and final accuracy (ACCURACY,
    the mean of a run's last evaluations) paired by cell and seed (sign-flip test, bootstrap interval), Holm
    over the two and the p-values times `looks`: reproduced if either favours `better` and neither `worse`; not
    reproduced if either favours `worse`, or both intervals lie inside their margins. The statistic writes the
    short names in lower case."""
    w, b = record.name(worse), record.name(better)
    coll = compare_collapse(sel, worse, better, MAIN_DEFINITION, cells)  # worse collapses more: better is better
    on = pair_keys((sel[sel["arm"] == better], sel[sel["arm"] == worse]), [*cells, "seed"])
    cols = [ACCURACY, *(["start"] if "start" in sel else [])]
    x = sel[sel["arm"] == better].set_index(on, drop=False)[cols].add_suffix("_b")
    y = sel[sel["arm"] == worse].set_index(on, drop=False)[cols].add_suffix("_w")
    joined = x.join(y, how="inner").dropna(subset=[f"{ACCURACY}_b", f"{ACCURACY}_w"])
    starts = pair_starts(joined)
    acc, acc_rev = (
        compare_pairs(joined[f"{ACCURACY}_b"], joined[f"{ACCURACY}_w"], starts, alternative=alt, n_resamples=N_BOOT)
        for alt in ("greater", "less")
    )
    favour_b = [looks_adjusted(p, looks) for p in holm([coll["p_more"], acc["p_value"]])]
    favour_w = [looks_adjusted(p, looks) for p in holm([coll["p_less"], acc_rev["p_value"]])]
    best_b, best_w = np.nanmin(favour_b, initial=np.inf), np.nanmin(favour_w, initial=np.inf)
    _, clo, chi = coll["diff"]
    m_acc, m_coll = record.margins[ACCURACY], record.margins["collapse"]
    if best_b < ALPHA and not best_w < ALPHA:
        verdict, reason = REPRODUCED, f"{b} better at Holm p = {fmt_p(float(best_b))}"
    elif best_w < ALPHA:
        verdict, reason = NOT_REPRODUCED, f"{w} better at Holm p = {fmt_p(float(best_w))}"
    elif -m_coll < clo and chi < m_coll and -m_acc < acc["lo"] and acc["hi"] < m_acc:
        verdict, reason = NOT_REPRODUCED, "both differences within their margins"
    else:
        verdict, reason = INCONCLUSIVE, "no significant difference and intervals wider than the margins"
    w, b = w.lower(), b.lower()
    return Result(
        worse,
        better,
        verdict,
        reason,
        float(np.nanmin(favour_b)) if np.isfinite(favour_b).any() else float("nan"),
        (
            f"collapsed {w} {coll['ka']} of {coll['na']} vs {b} {coll['kb']} of {coll['nb']}; final accuracy "
            f"{b} - {w} = {100 * acc['mean_diff']:+.1f} pp [{100 * acc['lo']:+.1f}, {100 * acc['hi']:+.1f}] "
            f"({acc['n']} pairs, P({b} > {w}) = {acc['prob_improvement']:.2f})"
        ),
        f"exact CMH p = {fmt_p(coll['p_more'])}, sign-flip p = {fmt_p(acc['p_value'])} (one-sided, Holm below"
        + (f", x {looks} looks)" if looks > 1 else ")"),
        {},
        [],
        acc,
    )


TESTS: dict[tuple[str, ...], Callable[..., Result]] = {ARMS_OUTCOMES: arms_result, COLLAPSE_OUTCOMES: collapse_result}


# --- measured from a run's own start ------------------------------------------------------------------


def from_own_start(runs: pd.DataFrame) -> pd.DataFrame:
    """Final accuracy (ACCURACY) minus `start_accuracy` (step 0) and `reward_auc` minus `start_reward` (the first
    steps), the raw values kept as `<ACCURACY>_raw` and `reward_auc_raw`: arms with cold starts of their own are
    compared on what they gained, so a head start cannot pass for stability."""
    return runs.assign(
        **{
            f"{ACCURACY}_raw": runs[ACCURACY],
            "reward_auc_raw": runs["reward_auc"],
            ACCURACY: runs[ACCURACY] - runs["start_accuracy"],
            "reward_auc": runs["reward_auc"] - runs["start_reward"],
        }
    )


def own_start_drop(runs: pd.DataFrame) -> dict[str, float]:
    """Final accuracy minus the run's own cold-start accuracy (a `from_own_start` frame's ACCURACY): mean
    with a bootstrap interval and a one-sided sign-flip p that it is below 0 (`p_value`), over starts from 5 up,
    else over runs (`stats.compare_pairs`); `below` counts the runs that end below their start."""
    change = runs[ACCURACY].to_numpy(float)
    starts = runs["start"].astype(str) if "start" in runs else None  # from 5 starts up, the start is the unit
    r = compare_pairs(change, np.zeros_like(change), starts, alternative="less", n_resamples=N_BOOT)
    return {**r, "below": int((change < 0).sum()), "runs": len(runs)}


def _drop_text(name: str, d: dict[str, float]) -> str:
    return (
        f"{name} final - its cold start {100 * d['mean_diff']:+.1f} pp [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}], "
        f"{d['below']} of {d['runs']} runs below it (one-sided p = {fmt_p(d['p_value'])})"
    )


# --- the engine ---------------------------------------------------------------------------------------


def combine(predicted: str, against: list[bool]) -> str:
    """The claim's verdict from its predicted comparison's and what speaks against it (a rival that beats the
    claimed arm, the claimed arm ending below its own cold start): not reproduced if anything speaks against
    it or the prediction fails; reproduced if the prediction holds; inconclusive otherwise."""
    if any(against) or predicted == NOT_REPRODUCED:
        return NOT_REPRODUCED
    return REPRODUCED if predicted == REPRODUCED else INCONCLUSIVE


def compared_runs(record: PairedClaim, runs: pd.DataFrame) -> pd.DataFrame:
    """`runs` with the compared arms in `arm`: where they are another column (e.g. the model `family`), the
    algorithm arm moves to `algo_arm`, a pairing key like the cell."""
    if record.compare_by == "arm":
        return runs
    return runs.rename(columns={"arm": "algo_arm"}).assign(arm=runs[record.compare_by].to_numpy())


def decide(record: PairedClaim, frame: pd.DataFrame, cells: list[str], looks: int) -> Decision:
    """The record's verdict on `frame` (compared arms in `arm`) by seed pairs, with its p-values times `looks`,
    and the independent cold starts behind it (a verdict needs MIN_UNITS: `_descriptive`)."""
    degrading = list(record.degrading or (record.worse, record.better))
    sel = runs_in_cells(frame, degrading, cells)
    if pair_runs(sel, record.worse, record.better, cells).empty:
        verdict, reason = record.no_cell
        tested = cell_list(frame, cells)
        return Decision(verdict, reason.format(degrading=" and ".join(degrading), tested=tested), sel, tested=tested)
    got = measure(record, from_own_start(sel) if record.from_own_start else sel, cells, looks)
    got.starts = independent_starts(sel, (record.worse, record.better))
    return got


def measure(record: PairedClaim, sel: pd.DataFrame, cells: list[str], looks: int) -> Decision:
    """The record's comparisons on the runs `sel` of the cells that count, and the verdict they give."""
    test = TESTS[record.outcomes]
    results = [test(sel, w, b, cells, looks, record) for w, b in ((record.worse, record.better), *record.rivals)]
    start = (
        {arm: own_start_drop(sel[sel["arm"] == arm]) for arm in (record.better, record.worse)}
        if record.holds_start
        else {}
    )
    guard = [bool(np.isfinite(p := start[record.better]["p_value"]) and p < ALPHA)] if record.holds_start else []
    pred, rivals = results[0], results[1:]
    grid = {
        d: (
            combine(v, [r.grid[d][0] == REPRODUCED for r in rivals] + guard),
            combine(k, [r.grid[d][1] == REPRODUCED for r in rivals] + guard),
        )
        for d, (v, k) in pred.grid.items()
    }
    verdict = combine(pred.verdict, [r.verdict == REPRODUCED for r in rivals] + guard)
    if not (rivals or record.holds_start):
        return Decision(verdict, pred.reason, sel, results, start, grid)
    label = record.label.format(worse=record.name(record.worse), better=record.name(record.better))
    parts = [f"{label}: {pred.verdict} ({pred.reason})"]
    parts += [f"{record.name(r.better)} vs {record.name(r.worse)}: {r.verdict} ({r.reason})" for r in rivals]
    if record.holds_start:
        p = start[record.better]["p_value"]
        parts.append(
            f"{record.holds_start} ends below its cold start: "
            + (f"yes (p = {fmt_p(p)})" if p < ALPHA else f"not significantly (p = {fmt_p(p)})")
        )
    return Decision(verdict, "; ".join(parts), sel, results, start, grid)


def _without(record: PairedClaim, base: Decision | None) -> str:
    """The verdict on the declared runs alone, for the looks note (a reason of several parts is left out); the
    seed-level reading as a reason where too few independent starts stand behind them."""
    if base is None:
        return ""
    reading = base.verdict if record.rivals or record.holds_start else f"{base.verdict} ({base.reason})"
    why = descriptive_reason(base.starts)
    return reading if why is None else f"{INCONCLUSIVE} ({why}; by seed pairs it reads: {reading})"


def _per_cell_notes(record: PairedClaim, sel: pd.DataFrame, cells: list[str]) -> list[str]:
    """Where the claim is judged pooled over several cells (the pairing keys but the algorithm arm, which pools
    within a cell): the same rule on each cell alone, descriptive, beside the pooled verdict, which decides.
    [] for a claim of one cell."""
    keys = [k for k in cells if k != "algo_arm"]
    groups = [
        (cell_label(keys, values), g)
        for values, g in sel.groupby(keys, sort=True)
        if not pair_runs(g, record.worse, record.better, cells).empty
    ]
    if len(groups) < 2:
        return []
    lead = (
        "per cell, descriptive: the rule applied to each cell alone (main collapse definition, no correction over "
        "cells or looks); the pooled verdict above decides"
    )
    return [lead, *(_cell_note(record, g, cells, label) for label, g in groups)]


def _cell_note(record: PairedClaim, g: pd.DataFrame, cells: list[str], label: str) -> str:
    """One cell alone: each arm's mean start -> final accuracy, its runs below the start and collapsed (main
    definition), better - worse final accuracy over the cell's pairs, and the record's rule on this cell."""
    raw = f"{ACCURACY}_raw" if record.from_own_start else ACCURACY
    outcome = OWN_START_WORDS["accuracy"] if record.from_own_start else "final accuracy"
    collapsed = f"collapsed_{MAIN_DEFINITION}"
    parts = [
        f"{arm} {100 * h['start_accuracy'].mean():.1f}% -> {100 * h[raw].mean():.1f}% "
        f"({int((h[raw] < h['start_accuracy']).sum())} of {len(h)} below the start, "
        f"{int(h[collapsed].astype(bool).sum())} collapsed)"
        for arm, h in ((a, g[g["arm"] == a]) for a in (record.worse, record.better))
    ]
    got = measure(record, g, cells, 1)
    acc = got.results[0].accuracy
    return (
        f"cell {label} alone: " + "; ".join(parts) + f"; {record.name(record.better)} - {record.name(record.worse)} "
        f"{outcome} {100 * acc['mean_diff']:+.1f} pp [{100 * acc['lo']:+.1f}, {100 * acc['hi']:+.1f}] "
        f"({acc['n']} pairs); the rule on this cell alone: {got.verdict}"
    )


def _fill(template: str, **values: str) -> str:
    """`template` filled in, leaving out each "; "-separated part whose field is empty."""
    parts = []
    for part in template.split("; "):
        fields = [name for _, name, _, _ in string.Formatter().parse(part) if name]
        if all(values[name] for name in fields):
            parts.append(part.format(**values))
    return "; ".join(parts)


def _judge(
    c: Claim, record: PairedClaim, raw: pd.DataFrame | None, declared: Declared | None, per_cell: bool = True
) -> None:
    """Fill `c` with the record's verdict on the per-run outcomes `raw` (None: no runs); with `per_cell`, the
    rule on each cell alone where there are several (`_per_cell_notes`)."""
    if raw is None:
        c.verdict, reason = record.no_data
        c.reason = reason.format(experiment=record.experiment)
        return
    runs = record.runs(raw)
    ext = extension_of(runs, declared)
    frame = compared_runs(record, runs)
    missing = sorted(set(record.arms) - set(frame["arm"]))
    if missing:
        c.verdict, reason = record.no_arms
        c.reason = reason.format(missing=missing, experiment=record.experiment)
        return
    cells = list(record.pairing) if record.pairing is not None else phase_cells(frame)
    base = decide(record, frame[ext == ""], cells, 1) if (ext != "").any() else None
    looks = looks_note(c, declared, ext, _without(record, base), list(record.outcomes))
    got = decide(record, frame, cells, looks)
    c.verdict, c.reason = got.verdict, got.reason
    if not got.results:
        c.cells = f"none of {got.tested} degrades"
        return
    pred = got.results[0]
    n = got.sel[cells].drop_duplicates().shape[0]
    degrading = " and ".join(record.degrading)
    template = record.cells_text or (
        f"{{n}} cell(s) where {degrading} degrades: {{cells}}" if degrading else "{n} degrading cell(s): {cells}"
    )
    c.cells = template.format(n=n, cells=cell_list(got.sel, cells))
    c.statistic = ". ".join(r.statistic for r in got.results)
    c.test = (record.test + (f", x {looks} looks" if looks > 1 else "")) if record.test else pred.test
    if record.holds_start:
        c.statistic += "; " + "; ".join(_drop_text(arm, got.start[arm]) for arm in (record.better, record.worse))
        c.test += f"; one-sided sign-flip ({record.name(record.better)} below its cold start)"
    c.p_value = pred.p
    if per_cell:
        c.notes += _per_cell_notes(record, got.sel, cells)
    for r in got.results:
        c.notes += r.notes
    if record.agreement:
        c.notes.append(
            f"agreement of the {MAIN_DEFINITION} and {ALTERNATIVE_DEFINITION} definitions: "
            + kappa_by_cell(runs, cells)
        )
    if got.grid:
        set_robustness(c, {d: v for d, (v, _) in got.grid.items()}, {d: k for d, (_, k) in got.grid.items()})
    _descriptive(c, got.starts)
    without = descriptive(base.verdict, "", base.starts)[0] if base is not None and looks > 1 else ""
    c.plain = _plain(record, c, got, looks, without)
    if c.plain and descriptive_reason(got.starts):
        c.plain += " " + descriptive_plain(got.starts)


def _descriptive(c: Claim, starts: int) -> None:
    """No verdict from fewer than MIN_UNITS independent cold starts (`rules.descriptive`): the claim is
    inconclusive, its seed-level reading (fragile included) kept in the reason and its grid of collapse
    definitions in the notes, marked descriptive; no p. The statistic stays: it describes the runs."""
    if descriptive_reason(starts) is None:
        return
    c.verdict, c.reason = descriptive(c.verdict, c.reason, starts)
    c.p_value = float("nan")
    c.statistic = INTERVAL.sub("", c.statistic)  # the seed-level intervals describe nothing the starts can carry
    c.notes = [_counts_only(n) if n.startswith(COUNTS_NOTE) else n for n in c.notes]
    if c.robustness:  # the grid reads the same seed pairs: it describes, it cannot decide either
        c.robustness = dict.fromkeys(c.robustness, INCONCLUSIVE)
        c.notes[0] = f"by seed pairs, descriptive: {c.notes[0]}"  # set_robustness put its note first


COUNTS_NOTE = "secondary, collapse counts"


def _counts_only(note: str) -> str:
    """A counts note (`arms.counts_note`) below MIN_UNITS starts: the counts and discordant pairs, without the Wilson
    intervals and the McNemar and log-rank tests, which would treat seeds of one start as independent."""
    head, _, rest = INTERVAL.sub("", note).partition(": ")
    return f"{head}, descriptive (counts only, no test): " + rest.split("; exact McNemar")[0]


def _plain(record: PairedClaim, c: Claim, got: Decision, looks: int, without: str) -> str:
    """The paragraph for a person: the record's template, else the arms test's own (the collapse test has none:
    the page words one from the row)."""
    pred = got.results[0].comparison
    if pred is None:
        return ""
    if not record.plain:
        second = got.results[1].comparison if len(got.results) > 1 else None
        return comparison_plain(
            c, pred, looks, without, second=second, descriptive=descriptive_reason(got.starts) is not None
        )
    acc, nan = got.results[0].accuracy, float("nan")
    own = {side: got.start.get(arm, {}) for side, arm in (("better", record.better), ("worse", record.worse))}
    return record.plain.format(
        better=record.better,
        worse=record.worse,
        pairs=acc["n"],
        ahead=accuracy_points(acc["mean_diff"]),
        better_change=100 * own["better"].get("mean_diff", nan),
        better_below=own["better"].get("below", 0),
        better_runs=own["better"].get("runs", 0),
        worse_change=100 * own["worse"].get("mean_diff", nan),
        verdict=c.verdict,
        would_change=would_change(c.verdict),
    )


def judge_paired(
    record: PairedClaim,
    root: Path,
    declared: Mapping[str, Declared] | None = None,
    *,
    runs: pd.DataFrame | None = None,
    cache: dict | None = None,
) -> Claim:
    """The CLAIMS.md row of `record` from the result folders under `root`, with the analyses `declared` by the
    experiment files (experiment -> `Declared`). `runs` stands in for the per-run outcomes of the record's
    experiment; `cache` holds loaded outcomes between claims that read the same folders."""
    declared = declared or {}
    cache = {} if cache is None else cache

    def load(experiment: str) -> pd.DataFrame | None:
        key = (experiment, record.grid)
        if key not in cache:
            cache[key] = phase_outcomes(root, experiment, grid=record.grid)
        return cache[key]

    c = Claim(record.id, record.claim, record.source, record.rule, experiment=record.experiment)
    raw = load(record.experiment) if runs is None else runs
    _judge(c, record, raw, declared.get(record.experiment))
    for also in record.also:
        other = load(also.experiment)
        if other is None or (also.pooled and raw is None):
            continue
        sub = Claim(record.id, record.claim, record.source, record.rule, experiment=also.experiment)
        if also.pooled:
            _judge(sub, record, pd.concat([raw, other], ignore_index=True), declared.get(record.experiment), False)
        else:
            _judge(sub, record, other, declared.get(also.experiment), False)
        families = ", ".join(sorted(set(raw["family"]))) if raw is not None and "family" in raw else ""
        c.notes.append(
            _fill(
                also.note,
                verdict=sub.verdict,
                reason=sub.reason,
                statistic=sub.statistic,
                test=sub.test,
                families=families,
            )
        )
    if record.describe is not None:
        c.notes += record.describe(root)
    return c
