"""A study as its declaration: one YAML under `experiments/conf/study/`, read here, written before its runs.

A declaration reads like a pre-registration. It names the question, the Hydra preset every run composes, the arms
(each a list of overrides) and the levels (each a list of overrides; a level may set the lr per reference model,
which an arm picks with `ref` and scales with `lr_scale`), the unit of replication (the pool members it draws, new
for each study, and the seeds per member), the outcome (one named definition), the contrasts (a linear combination
of cells `arm@level`, paired on the run seed (pool member and replicate), with the claimed direction, the claim it
decides or "exploratory", optionally the reference's own degradation that makes it testable, and optionally an
outcome of its own with its MDE and margin in that outcome's units), and the design:
the smallest difference it is sized to detect, its power and level, the looks (starts after which it decides) and
where its start count came from. A study may admit only warm-ups with reward signal (`unit.admit`:
`min_sampled_reward`, `max_zero_variance`, read from the covariates each warm-up records). `load_study` refuses a declaration whose first look is too small to decide anything (fewer than 3 starts),
whose looks need more starts than it draws, or whose contrasts name cells it does not run.

Member m of a study's pool is the warm-up at cold-start seed m (`cold_start.pool` is set above any member, so run
seed m starts from member m; replicate r of member m runs at seed m + r * POOL). A study run before this format
(its design in a preset) is declared as it ran: `unit.pool` names the pool its preset's cold start draws from (run
seed s starts from member s mod pool; the launcher then passes no `cold_start.pool`, so its runs keep their names),
`runs` lists its cells in run order (controls no contrast reads included; a block may name the `replicates` it ran
of each member), `not_run` the seeds a cell skipped as it ran (the launcher lists them not, the looks do not wait
for them), `columns` the run means its cell table adds (name: metric key), `claims` the statement and source
of each claim it first decided, and `declared` where and when its design was written; `unit.start: member` makes
the pool member the unit (its twins warmed on two machines one start). `unit.admit.in_band` admits only warm-ups
that ended inside their band. Any study may name `axes` (an axis: its levels in order), which its report draws as
each arm's profile along the axis, and `readme` (true,
or the contrasts to show), which puts a table of it into README.md (`python -m moe_rl.report --readme`). A study
that needs a computation of its own (a crossing, a slope) names it in `sections` ("module:function", called by its
report with the study, its result and the output folder, returning markdown lines and the files it wrote). A study
is one numerics domain: `compiled: true` runs every run compiled (`compile=true`, inductor's kernels), the default
every run eager; its report names the domain its runs recorded, and a run outside it is refused by the report.

Two cells a study runs that compose to the same run config (their `run_overrides` expanded through the config
groups of the Hydra config folder above the declaration's, later values over earlier ones, keys that change nothing
a run computes left out: `_same_config`) inform nothing one of them does not: `load_study` refuses them, naming
them, unless one group of `duplicates` names them all: a list of {cells: [arm@level, ...] (two or more), reason: why
they all run}. A group may also name cells whose configs differ but whose runs are known to repeat one another's
numbers (staleness_erosion's S = 1 cells, where every ratio is 1), so that the report can say so.

`match` brings arms to a reference's divergence (`Match`: `divergence`, `tolerance`, `placebo`, `contrasts`). With
`match.reference: ARM` it does so per start, by probes (`moe_rl.studies.matching`): before each look's runs, each
cell runs `match.probe_steps` steps (default 20, at most 15% of its run's steps) at each run seed, the reference at
its declared lr, every other arm at each multiplier of its declared lr in `match.bracket` (default [0.8, 1.0,
1.25]); each run then goes at the lr where its probes' log KL on log lr reaches the reference's probe KL on the
same seed. With `match.confirm` (multipliers of each seed's solved lr, e.g. [0.95, 1.0, 1.05]) each arm's seed also
probes there, and its run goes at the lr of whichever of those probes came nearest the reference's KL: the run's
first steps are that probe, so its realised ratio is known before it runs. Such a study must declare levels with an lr per
reference model and a placebo (`check_match`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from moe_rl.studies.declaration_keys import read_declaration

POOL = 1_000_000  # cold_start.pool of a declared study: run seed m + r * POOL starts from member m
DIRECTIONS = ("greater", "less")
OUTCOMES = {  # one named definition each: what every table of the study prints
    "change": "late accuracy (the mean of a run's last 3 evaluations) minus its step-0 accuracy",
    "routing_share": "the run mean of `ratio/split/routing_share`, routing's share of the token log-ratio variance",
    "drift": "the run mean of `route/old_vs_new/flip_rate/offpolicy`, the share of (token, MoE layer) routes an "
    "off-policy update flips",
}
UNITS = {"change": "pp", "routing_share": "points of share", "drift": "pp of routes"}  # each outcome x 100
TWINS_UNIT = "pool members (a member's warm-ups on two machines one unit)"  # `unit.start: member`


def member_start(seed: int, pool: int) -> str:
    """The start a run of `seed` counts under where the pool member is the unit: member seed mod pool."""
    return f"member {int(seed) % pool}"


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]
    ref: str | None = None  # the reference model whose level lr it runs at (levels that set lr per reference)
    lr_scale: float = 1.0


@dataclass(frozen=True)
class Level:
    name: str
    overrides: tuple[str, ...]
    lr: dict[str, float] = field(default_factory=dict)  # per reference model; empty: the preset's lr


@dataclass(frozen=True)
class Contrast:
    name: str
    weights: dict[tuple[str, str], float]  # (arm, level) -> weight
    direction: str  # the claimed sign of the combination: greater (> 0) or less (< 0)
    claim: str  # a claim id, or "exploratory"
    requires: dict[tuple[str, str], float] = field(default_factory=dict)  # the reference's degradation
    requires_below: float = 0.0  # testable only where the `requires` combination's mean is below this
    outcome: str | None = None  # what it combines; None: the study's outcome
    mde: float | None = None  # in its outcome's units; None: the design's
    margin: float | None = None

    @property
    def sign(self) -> float:
        return 1.0 if self.direction == "greater" else -1.0


@dataclass(frozen=True)
class Design:
    mde: float  # the smallest difference (outcome units) the design is sized to detect
    power: float
    alpha: float  # one-sided, in the claimed direction, spent over the looks
    looks: tuple[int, ...]  # starts after which the contrasts are decided
    margin: float  # |difference| below this does not matter: a claimed effect this large excluded is "not reproduced"
    sized_from: str  # where the start count came from (the pilot or runs, their components)
    margin_relative: float | None = None  # where set, the margin is this share of the reference's own loss
    futility: bool = True  # non-binding futility boundaries (beta spending at 1 - power) stop a study early


@dataclass(frozen=True)
class Match:
    """Arms brought to a reference's divergence per start (`match:` in a declaration). `divergence` names the per-run
    divergence (`kl_acting`: the early per-update KL on the routes the arm acts with); a matched contrast whose
    realised ratio (geometric mean over starts of the arm's over the reference's) lies outside [1/tolerance,
    tolerance] reads **unmatched**; `placebo` names the contrast of the reference against itself at another lr,
    matched back like any arm: outside +-margin it invalidates every matched verdict of the study."""

    divergence: str = "kl_acting"
    tolerance: float = 1.05
    placebo: str | None = None
    contrasts: tuple[str, ...] = ()  # the contrasts it holds for (empty: every contrast but the placebo)
    # matched per start by probes (`moe_rl.studies.matching`, `experiments/study.py`); None: the lrs as declared
    reference: str | None = None  # the arm the others are matched to, at its own declared lr
    probe_steps: int = 20  # a probe: the run's first steps at the cell and seed, from the member's warm-up
    bracket: tuple[float, ...] = (0.8, 1.0, 1.25)  # lr multipliers of each arm's declared lr its probes run at
    # multipliers of each seed's solved lr it also probes at; the run takes its nearest probe's lr (empty: the solved)
    confirm: tuple[float, ...] = ()
    # "start": each seed its own lr from its own probes; "pool": one lr per arm and level for every seed, where the
    # mean over the first look's seeds of the log KL ratio to the reference crosses 0 (`matching.pooled_lrs`)
    per: str = "start"

    @property
    def probes(self) -> bool:
        """Whether the study matches per start by probes (`reference` set)."""
        return self.reference is not None

    @property
    def pooled(self) -> bool:
        """Whether each arm runs every seed at one lr (`per: pool`)."""
        return self.per == "pool"

    @property
    def scope(self) -> str:
        """How the arms are matched, in words: "per start" or "over the pool"."""
        return "over the pool" if self.pooled else "per start"

    def covers(self, contrast: str) -> bool:
        return contrast != self.placebo and (not self.contrasts or contrast in self.contrasts)


@dataclass(frozen=True)
class Pilot:
    """A pilot across starts (`pilot:` in a declaration, no contrasts): where `reference` reaches a loss in `loss`
    (late minus step-0 accuracy, as a positive fraction) with at most `floor` of its runs at accuracy 0
    (`moe_rl.studies.pilot`)."""

    reference: str
    loss: tuple[float, float] = (0.10, 0.20)
    floor: float = 0.5


@dataclass(frozen=True)
class Statement:
    """A claim as its paper states it: the text CLAIMS.md prints and where it comes from."""

    text: str
    source: str


@dataclass(frozen=True)
class Admission:
    """Which warm-ups a study admits, by the covariates recorded at the warm-up's end (8 temperature-1 samples per
    held-out prompt, the default group size): a start RL cannot move is reported and left out of every contrast."""

    min_sampled_reward: float = 0.0  # the mean reward of those samples
    max_zero_variance: float = 1.0  # the share of held-out prompts whose samples are all wrong or all right
    in_band: bool = False  # only warm-ups that ended inside their band of greedy accuracy

    @property
    def bounds_covariates(self) -> bool:
        """Whether it sets a bound on the sampled reward or the zero-variance share."""
        return (self.min_sampled_reward, self.max_zero_variance) != (0.0, 1.0)

    def admits(self, sampled_reward: float, zero_variance: float, in_band: bool = True) -> bool:
        """Whether a start with these covariates is admitted (NaN, not recorded: not admitted unless no bound is set)."""
        if self.in_band and not in_band:
            return False
        if not self.bounds_covariates:
            return True
        return bool(sampled_reward >= self.min_sampled_reward and zero_variance <= self.max_zero_variance)


@dataclass(frozen=True)
class AsRan:
    """A study whose runs its presets made, re-read by the one rule: each run lies in runs/ under the name Hydra gave
    it (its overrides, `k=v,k=v,...,seed=s`) and belongs to the cell whose overrides its name lists, less its seed
    and `member`. Run seed s of member m reads as seed m + s * pool, so the rule pairs and counts starts as it does
    for a launched study."""

    member: str | None = None  # the override naming the run's pool member (cold_start.seed); None: member 0

    def cell_and_seed(self, name: str, cells: dict[str, frozenset[str]], pool: int) -> tuple[str, int] | None:
        """The cell (arm@level) and the study's run seed of the run folder `name`; None where no cell lists it."""
        tokens = dict(t.split("=", 1) for t in name.split(",") if "=" in t)
        if "seed" not in tokens:
            return None
        member = int(tokens.pop(self.member)) if self.member is not None and self.member in tokens else 0
        seed = int(tokens.pop("seed"))
        mine = frozenset(f"{k}={_number(v)}" for k, v in tokens.items())
        found = [c for c, overrides in cells.items() if overrides == mine]
        return (found[0], member + seed * pool) if found else None


def _number(text: str) -> str:
    """An override's value as one spelling (2.5e-4 and 0.00025 alike)."""
    try:
        return repr(float(text))
    except ValueError:
        return text


@dataclass(frozen=True)
class Study:
    name: str
    question: str
    preset: str
    overrides: tuple[str, ...]
    arms: dict[str, Arm]
    levels: dict[str, Level]
    members: tuple[int, ...]
    seeds_per_start: int
    outcome: str
    contrasts: tuple[Contrast, ...]
    design: Design
    file: Path
    admission: Admission = Admission()
    pool: int | None = None  # the preset's cold-start pool (None: POOL, passed on the command line)
    runs: tuple[tuple[str, str], ...] = ()  # cells run beside those the contrasts read, in run order
    replicates: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)  # where not range(seeds_per_start)
    columns: dict[str, str] = field(default_factory=dict)  # run means the cell table adds: name -> metric key
    claims: dict[str, Statement] = field(default_factory=dict)  # claim id -> its statement
    declared: str = ""  # where and when the design was written ("": this file, before its runs)
    axes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # an axis: its levels in order (the profile plot)
    readme: tuple[str, ...] | None = None  # the contrasts README.md's table of it shows (): all; None: no table
    sections: tuple[str, ...] = ()  # "module:function" of its own computations, called by its report
    compiled: bool = False  # its numerics domain: every run compiled (compile=true), or every run eager
    by_member: bool = False  # the unit is the pool member (seed mod pool): its twins warmed elsewhere count once
    not_run: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)  # seeds a cell skipped, as it ran
    match: Match | None = None  # arms matched to a reference's divergence per start; None: not a matched study
    pilot: Pilot | None = None  # a pilot: decides nothing, reads where its reference reaches the declared loss
    as_ran: AsRan | None = None  # runs its presets made, named by their overrides; None: launched as arm@level

    @property
    def member_pool(self) -> int:
        """Run seed s starts from pool member s mod this."""
        return POOL if self.pool is None else self.pool

    def outcome_of(self, contrast: Contrast) -> str:
        return contrast.outcome or self.outcome

    def margin_of(self, contrast: Contrast) -> float:
        return self.design.margin if contrast.margin is None else contrast.margin

    def mde_of(self, contrast: Contrast) -> float:
        return self.design.mde if contrast.mde is None else contrast.mde

    def other_outcomes(self) -> tuple[str, ...]:
        """The outcomes some contrast reads besides the study's own, in declaration order."""
        return tuple(dict.fromkeys(o for c in self.contrasts if (o := self.outcome_of(c)) != self.outcome))

    def cells(self) -> list[tuple[str, str]]:
        """Every (arm, level) the study runs: its `runs` in their order, then those some contrast reads (a pilot:
        every arm at every level), in declaration order (arms, then levels)."""
        used = {c for contrast in self.contrasts for c in (*contrast.weights, *contrast.requires)}
        read = [(a, lv) for a in self.arms for lv in self.levels if (a, lv) in used or self.pilot is not None]
        return list(dict.fromkeys([*self.runs, *read]))

    def cell_overrides(self, arm: str, level: str) -> list[str]:
        """The overrides of one cell: the study's, the arm's, the level's, and the lr its reference gets there."""
        a, lv = self.arms[arm], self.levels[level]
        out = [*self.overrides, *a.overrides, *lv.overrides]
        if lv.lr:
            out.append(f"optim.lr={lv.lr[str(a.ref)] * a.lr_scale:.6g}")
        if self.compiled:
            out.append("compile=true")
        return out

    def run_overrides(self, arm: str, level: str) -> list[str]:
        """A run of one cell as the launcher composes it, less its seed and where it writes: the preset, the pool
        (`cold_start.pool` on the command line, unless the preset names its own: its runs keep their names), the
        cell's overrides."""
        pool = [f"cold_start.pool={POOL}"] if self.pool is None else []
        return [f"+preset={self.preset}", *pool, *self.cell_overrides(arm, level)]

    def cell_replicates(self, arm: str, level: str) -> tuple[int, ...]:
        """The replicates r a cell runs of each member (seed m + r * pool): its `runs` blocks' (all of them where
        several list it), else 0 .. seeds_per_start - 1."""
        return self.replicates.get((arm, level), tuple(range(self.seeds_per_start)))

    def as_ran_cells(self) -> dict[str, frozenset[str]]:
        """Each cell's overrides as a run folder's name spells them (`AsRan`): the arm's and the level's."""
        return {
            f"{a}@{lv}": frozenset(
                f"{k}={_number(v)}" for k, _, v in (o.partition("=") for o in self.cell_overrides(a, lv))
            )
            for a, lv in self.cells()
        }

    def seeds(self, starts: int, cell: tuple[str, str] | None = None) -> list[int]:
        """Run seeds of the first `starts` members, each at the cell's replicates (default: `seeds_per_start`), less
        those the cell skipped as it ran (`not_run`)."""
        reps = self.cell_replicates(*cell) if cell else tuple(range(self.seeds_per_start))
        skipped = set(self.not_run.get(cell, ())) if cell else set()
        seeds = [m + r * self.member_pool for m in self.members[:starts] for r in reps]
        return [s for s in seeds if s not in skipped]


def _cell(text: str, study: str) -> tuple[str, str]:
    arm, sep, level = text.partition("@")
    if not sep:
        raise ValueError(f"study {study}: cell {text!r} is not arm@level")
    return arm, level


def _combination(raw: dict, study: str) -> dict[tuple[str, str], float]:
    return {_cell(str(k), study): float(v) for k, v in (raw or {}).items()}


def _members(raw: object, study: str) -> tuple[int, ...]:
    """`first..last` (inclusive) or a list of member ids."""
    if isinstance(raw, str) and (m := re.fullmatch(r"(\d+)\.\.(\d+)", raw.strip())):
        return tuple(range(int(m.group(1)), int(m.group(2)) + 1))
    if isinstance(raw, list) and raw and all(isinstance(v, int) for v in raw):
        return tuple(raw)
    raise ValueError(f"study {study}: unit.members {raw!r} must be 'first..last' or a list of member ids")


def _admission(raw: dict | None, study: str) -> Admission:
    known = ("min_sampled_reward", "max_zero_variance", "in_band")
    unknown = sorted(set(raw or {}) - set(known))
    if unknown:
        raise ValueError(f"study {study}: unit.admit keys {unknown} are not among {list(known)}")
    raw = dict(raw or {})
    in_band = raw.pop("in_band", False)
    if not isinstance(in_band, bool):
        raise ValueError(f"study {study}: unit.admit.in_band {in_band!r} must be true or false")
    return Admission(**{k: float(v) for k, v in raw.items()}, in_band=in_band)


def _runs(raw: list | None) -> tuple[tuple[tuple[str, str], ...], dict[tuple[str, str], tuple[int, ...]]]:
    """`runs`: blocks of {arms: [...], levels: [...], replicates: [...] (optional)}, each its arms x levels, level by
    level, in order; and the replicates of each cell some block names them for (the union over its blocks)."""
    cells: list[tuple[str, str]] = []
    reps: dict[tuple[str, str], set[int]] = {}
    for block in raw or ():
        block_cells = [(a, lv) for lv in block["levels"] for a in block["arms"]]
        cells += block_cells
        if "replicates" in block:
            for cell in block_cells:
                reps.setdefault(cell, set()).update(int(r) for r in block["replicates"])
    return tuple(dict.fromkeys(cells)), {c: tuple(sorted(r)) for c, r in reps.items()}


def _not_run(raw: list | None, arms: tuple[str, ...], study: str) -> dict[tuple[str, str], tuple[int, ...]]:
    """`not_run`: blocks of {levels: [...], arms: [...] (optional: every arm), seeds: [...]}, the run seeds those
    cells skipped as the study ran (their pool member's warm-up ended outside its band on the machine that ran them),
    so its launcher lists them not and its looks do not wait for them."""
    out: dict[tuple[str, str], set[int]] = {}
    for block in raw or ():
        lists = {k: block.get(k) for k in ("levels", "arms", "seeds") if k in block}
        if (
            set(block) - {"levels", "arms", "seeds"}
            or not {"levels", "seeds"} <= set(block)
            or not all(isinstance(v, list) and v for v in lists.values())
        ):
            raise ValueError(
                f"study {study}: not_run block {block} must have non-empty lists levels and seeds, and optionally arms"
            )
        for lv in block["levels"]:
            for arm in block.get("arms") or arms:
                out.setdefault((str(arm), str(lv)), set()).update(int(s) for s in block["seeds"])
    return {c: tuple(sorted(v)) for c, v in out.items()}


def _match(raw: dict | None, study: str) -> Match | None:
    """`match`: {divergence, tolerance, placebo, contrasts, reference, probe_steps, bracket, confirm, per}
    (`Match`); None where the study matches nothing per start."""
    if raw is None:
        return None
    known = ("divergence", "tolerance", "placebo", "contrasts", "reference", "probe_steps", "bracket", "confirm", "per")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"study {study}: match keys {unknown} are not among {list(known)}")
    tolerance = float(raw.get("tolerance", Match.tolerance))
    if not tolerance > 1:
        raise ValueError(f"study {study}: match.tolerance {tolerance} must exceed 1 (a ratio band [1/t, t])")
    placebo = raw.get("placebo")
    steps = raw.get("probe_steps", Match.probe_steps)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"study {study}: match.probe_steps {steps!r} must be a whole number of steps >= 1")
    bracket = raw.get("bracket", list(Match.bracket))
    if (
        not isinstance(bracket, list)
        or len(bracket) < 2
        or not all(isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in bracket)
        or bracket != sorted(set(bracket))
    ):
        raise ValueError(
            f"study {study}: match.bracket {bracket!r} must list 2 or more increasing lr multipliers > 0 (each arm's "
            "probes fit log KL on log lr over them)"
        )
    confirm = raw.get("confirm", [])
    if (
        not isinstance(confirm, list)
        or not all(isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in confirm)
        or confirm != sorted(set(confirm))
    ):
        raise ValueError(
            f"study {study}: match.confirm {confirm!r} must list increasing multipliers > 0 of each seed's solved lr"
        )
    reference = raw.get("reference")
    if confirm and reference is None:
        raise ValueError(f"study {study}: match.confirm probes around each seed's solved lr: it needs match.reference")
    per = raw.get("per", Match.per)
    if per not in ("start", "pool"):
        raise ValueError(f"study {study}: match.per {per!r} must be 'start' (an lr per seed) or 'pool' (one per arm)")
    if per == "pool" and reference is None:
        raise ValueError(f"study {study}: match.per 'pool' solves each arm's lr from probes: it needs match.reference")
    if per == "pool" and confirm:
        raise ValueError(
            f"study {study}: match.confirm picks each seed's own probe; with match.per 'pool' every seed runs at its "
            "arm's one lr (declare one or the other)"
        )
    return Match(
        divergence=str(raw.get("divergence", Match.divergence)),
        tolerance=tolerance,
        placebo=None if placebo is None else str(placebo),
        contrasts=tuple(str(c) for c in raw.get("contrasts") or ()),
        reference=None if reference is None else str(reference),
        probe_steps=steps,
        bracket=tuple(float(x) for x in bracket),
        confirm=tuple(float(x) for x in confirm),
        per=str(per),
    )


def check_match(study: Study) -> None:
    """Refuse a study matched by probes (`match.reference`) that cannot be: the reference must be an arm run at every
    level another arm runs at, each level must set the lr per reference model (the bracket multiplies it), and the
    study must carry a placebo: `match.placebo` names a contrast of one arm against the reference at one level, the
    arm the reference's model and method (its overrides and `ref`) at another `lr_scale`, matched back like any arm,
    so that what it reads is what the matching itself adds."""
    m, name = study.match, study.name
    if m is None or m.reference is None:
        return
    if m.divergence != "kl_acting":
        raise ValueError(
            f"study {name}: match.divergence {m.divergence!r}: probes read the early acting KL (`kl_acting`) alone"
        )
    ref = study.arms.get(m.reference)
    if ref is None:
        raise ValueError(f"study {name}: match.reference {m.reference!r} is not one of its arms {sorted(study.arms)}")
    cells = study.cells()
    unmatched = sorted({lv for a, lv in cells if a != ref.name and (ref.name, lv) not in cells})
    if unmatched:
        raise ValueError(f"study {name}: match.reference {ref.name} is not run at levels {unmatched}, which others are")
    no_lr = sorted({lv for _, lv in cells if not study.levels[lv].lr})
    if no_lr:
        raise ValueError(
            f"study {name}: levels {no_lr} set no lr per reference model (`lr:`); a matched study's probes multiply "
            "each arm's declared lr"
        )
    placebo = next((c for c in study.contrasts if c.name == m.placebo), None)
    if placebo is None:
        raise ValueError(
            f"study {name}: a study matched by probes carries a placebo: `match.placebo` names the contrast of the "
            f"reference's model and method at another lr against {ref.name} (none named)"
        )
    others = {a for a, _ in placebo.weights} - {ref.name}
    arm = study.arms[next(iter(others))] if len(others) == 1 else None
    levels = {lv for _, lv in placebo.weights}
    if (
        arm is None
        or len(levels) != 1
        or len(placebo.weights) != 2
        or sorted(placebo.weights.values()) != [-1.0, 1.0]
        or arm.overrides != ref.overrides
        or arm.ref != ref.ref
        or arm.lr_scale == ref.lr_scale
    ):
        raise ValueError(
            f"study {name}: placebo {placebo.name} must be one arm minus {ref.name} at one level, the arm {ref.name}'s "
            "overrides and ref at another lr_scale (the reference's model and method at another lr)"
        )


def _pilot(raw: object, path: Path) -> Pilot | None:
    """`pilot`: {reference: ARM, loss: [lo, hi], floor: share}; None where the study is not a pilot."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or "reference" not in raw:
        raise ValueError(f"{path}: pilot must name its reference arm: pilot: {{reference: ARM, loss: [0.1, 0.2]}}")
    loss = raw.get("loss", list(Pilot.loss))
    if (
        not (isinstance(loss, list) and len(loss) == 2 and all(isinstance(x, int | float) for x in loss))
        or not 0 <= loss[0] < loss[1] <= 1
    ):
        raise ValueError(f"{path}: pilot.loss {loss!r} must be [lo, hi] with 0 <= lo < hi <= 1 (accuracy lost)")
    floor = float(raw.get("floor", Pilot.floor))
    if not 0 <= floor <= 1:
        raise ValueError(f"{path}: pilot.floor {floor} must be a share in [0, 1]")
    return Pilot(str(raw["reference"]), (float(loss[0]), float(loss[1])), floor)


def _as_ran(raw: dict, path: Path) -> AsRan | None:
    if "as_ran" not in raw:
        return None
    body = raw["as_ran"] or {}
    if not raw.get("declared"):
        raise ValueError(f"{path}: as_ran re-reads runs its presets made: say where its design was written (declared)")
    if "unit" in raw and raw["unit"].get("pool") is None:
        raise ValueError(f"{path}: as_ran needs unit.pool, the pool its runs' members come from (1: one cold start)")
    return AsRan(member=None if body.get("member") is None else str(body["member"]))


def _start(raw: object, study: str) -> bool:
    if raw not in ("cold start", "member"):
        raise ValueError(
            f"study {study}: unit.start {raw!r} must be 'cold start' (each warm-up a unit) or 'member' (a pool "
            "member's warm-ups in two environments one unit)"
        )
    return raw == "member"


def _flag(raw: object, key: str, study: str) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(f"study {study}: {key} {raw!r} must be true or false")
    return raw


def _compiled(raw: object, study: str) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(
            f"study {study}: compiled {raw!r} must be true (every run compiled) or false (every run eager)"
        )
    return raw


def load_study(path: str | Path) -> Study:
    """The study declared in `path`, checked (see the module docstring); a ValueError says what is wrong."""
    path = Path(path)
    raw = read_declaration(path)
    name = str(raw.get("name") or path.stem)
    if "arms" not in raw:
        raise ValueError(
            f"{path}: {name} declares a results folder, not a study (no arms): its runs came from its presets "
            f"({', '.join(map(str, raw.get('presets') or [])) or 'none'}), so there is nothing to launch or decide"
        )
    arms = {
        k: Arm(k, tuple(v.get("overrides", ())), v.get("ref"), float(v.get("lr_scale", 1.0)))
        for k, v in raw["arms"].items()
    }
    levels = {
        k: Level(
            k, tuple((v or {}).get("overrides", ())), {r: float(x) for r, x in ((v or {}).get("lr") or {}).items()}
        )
        for k, v in raw["levels"].items()
    }
    contrasts = tuple(
        Contrast(
            name=str(c["name"]),
            weights=_combination(c["cells"], name),
            direction=str(c.get("direction", "greater")),
            claim=str(c.get("claim", "exploratory")),
            requires=_combination(c.get("requires", {}), name),
            requires_below=float(c.get("requires_below", 0.0)),
            outcome=c.get("outcome"),
            mde=None if c.get("mde") is None else float(c["mde"]),
            margin=None if c.get("margin") is None else float(c["margin"]),
        )
        for c in raw.get("contrasts") or ()
    )
    pilot = _pilot(raw.get("pilot"), path)
    d = raw["design"]
    if pilot is not None:  # a pilot sizes the study after it: the MDE it reports starts for, a look per bracket
        d = {"mde": 0.05, "sized_from": "a pilot: it decides nothing", **d}
    design = Design(
        mde=float(d["mde"]),
        power=float(d.get("power", 0.8)),
        alpha=float(d.get("alpha", 0.025)),
        looks=tuple(int(x) for x in d["looks"]),
        margin=float(d.get("margin", d["mde"])),
        sized_from=" ".join(str(d["sized_from"]).split()),
        margin_relative=None if d.get("margin_relative") is None else float(d["margin_relative"]),
        futility=_flag(d.get("futility", True), "design.futility", name),
    )
    unit = raw["unit"]
    runs, replicates = _runs(raw.get("runs"))
    study = Study(
        name=name,
        question=" ".join(str(raw["question"]).split()),
        preset=str(raw["preset"]),
        overrides=tuple(raw.get("overrides", ())),
        arms=arms,
        levels=levels,
        members=_members(unit["members"], name),
        seeds_per_start=int(unit.get("seeds_per_start", 1)),
        outcome=str(raw.get("outcome", "change")),
        contrasts=contrasts,
        design=design,
        file=path,
        admission=_admission(unit.get("admit"), name),
        pool=None if unit.get("pool") is None else int(unit["pool"]),
        runs=runs,
        replicates=replicates,
        columns={str(k): str(v) for k, v in (raw.get("columns") or {}).items()},
        claims={str(k): Statement(str(v["text"]), str(v["source"])) for k, v in (raw.get("claims") or {}).items()},
        declared=" ".join(str(raw.get("declared", "")).split()),
        axes={str(k): tuple(str(x) for x in v) for k, v in (raw.get("axes") or {}).items()},
        readme=None if raw.get("readme") is None else () if raw["readme"] is True else tuple(map(str, raw["readme"])),
        sections=tuple(str(x) for x in raw.get("sections") or ()),
        compiled=_compiled(raw.get("compiled", False), name),
        by_member=_start(unit.get("start", "cold start"), name),
        not_run=_not_run(raw.get("not_run"), tuple(arms), name),
        match=_match(raw.get("match"), name),
        pilot=pilot,
        as_ran=_as_ran(raw, path),
    )
    check_study(study)
    check_match(study)
    _check_members(study, unit.get("reuse") or {})
    return study


def _check_members(study: Study, reuse: object) -> None:
    """A study declared before its runs draws new pool members: refuse members another declaration in its folder
    draws, unless `unit.reuse` names that study with the reason (a study declared as it ran keeps the pool it ran)."""
    if not isinstance(reuse, dict) or not all(isinstance(v, str) and v.strip() for v in reuse.values()):
        raise ValueError(f"{study.file}: unit.reuse must map each study whose members it shares to why")
    if study.declared:
        return
    mine = set(study.members)
    for other in sorted(study.file.parent.glob("*.yaml")):
        if other == study.file:
            continue
        try:
            raw = yaml.safe_load(other.read_text()) or {}
            name = str(raw.get("name") or other.stem)
            theirs = set(_members(raw["unit"]["members"], name))
        except (yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError):
            continue  # not a declaration it could share with; refused on its own load
        shared = sorted(mine & theirs)
        if shared and name not in reuse:
            raise ValueError(
                f"{study.file}: unit.members share {len(shared)} members ({shared[0]}..{shared[-1]}) with study "
                f"{name}: a new study draws new pool members (e.g. from {max(mine | theirs) + 1}); to reuse them, "
                f"name it under unit.reuse with why"
            )


MIN_STARTS = 3  # a first look on fewer starts (a t with 1 degree of freedom) has next to no power at spent levels


def check_study(study: Study) -> None:
    """Refuse a declaration that cannot decide what it declares, naming the reason and what it would need."""
    name, d = study.name, study.design
    if study.outcome not in OUTCOMES:
        raise ValueError(f"study {name}: outcome {study.outcome!r} is not one of {sorted(OUTCOMES)}")
    if study.pilot is not None:
        if study.contrasts or study.match is not None:
            raise ValueError(
                f"{study.file}: a pilot decides nothing: declare its contrasts and match in the study it sizes"
            )
        if study.pilot.reference not in study.arms:
            raise ValueError(f"{study.file}: pilot.reference {study.pilot.reference!r} is not one of its arms")
    elif not study.contrasts:
        raise ValueError(
            f"{study.file}: no contrasts: a study decides contrasts; a run of cells that decides nothing is a "
            "pilot (pilot: {reference: ARM})"
        )
    sets_compile = [
        o
        for o in (
            *study.overrides,
            *(o for a in study.arms.values() for o in a.overrides),
            *(o for lv in study.levels.values() for o in lv.overrides),
        )
        if o.startswith("compile=")
    ]
    if sets_compile:
        raise ValueError(
            f"study {name}: {sets_compile[0]!r} in its overrides; a study's numerics domain is one for every run: "
            "declare `compiled: true` (or leave it out: every run eager)"
        )
    for c in study.contrasts:
        if study.outcome_of(c) not in OUTCOMES:
            raise ValueError(f"study {name}, contrast {c.name}: outcome {c.outcome!r} is not one of {sorted(OUTCOMES)}")
        if study.mde_of(c) <= 0 or study.margin_of(c) < 0:
            raise ValueError(f"study {name}, contrast {c.name}: mde {c.mde} or margin {c.margin} out of range")
        if c.direction not in DIRECTIONS:
            raise ValueError(f"study {name}, contrast {c.name}: direction {c.direction!r} not in {DIRECTIONS}")
        unknown = [f"{a}@{lv}" for a, lv in (*c.weights, *c.requires) if a not in study.arms or lv not in study.levels]
        if unknown:
            raise ValueError(f"study {name}, contrast {c.name}: cells {unknown} name an arm or level it does not run")
        if not c.weights:
            raise ValueError(f"study {name}, contrast {c.name}: no cells")
        if abs(sum(c.weights.values())) > 1e-12:
            raise ValueError(f"study {name}, contrast {c.name}: weights sum to {sum(c.weights.values())}, not 0")
    unknown_axes = {k: [lv for lv in v if lv not in study.levels] for k, v in study.axes.items()}
    if any(unknown_axes.values()):
        raise ValueError(f"study {name}: axes name levels it does not declare: {unknown_axes}")
    malformed = [f for f in study.sections if f.count(":") != 1]
    if malformed:
        raise ValueError(f"study {name}: sections {malformed} are not module:function")
    unknown_shown = sorted(set(study.readme or ()) - {c.name for c in study.contrasts})
    if unknown_shown:
        raise ValueError(f"study {name}: readme shows contrasts it does not declare: {unknown_shown}")
    unknown_runs = [
        f"{a}@{lv}" for a, lv in (*study.runs, *study.not_run) if a not in study.arms or lv not in study.levels
    ]
    if unknown_runs:
        raise ValueError(f"study {name}: runs {unknown_runs} name an arm or level it does not declare")
    for cell, seeds in study.not_run.items():
        reps = study.cell_replicates(*cell)
        foreign = sorted(set(seeds) - {m + r * study.member_pool for m in study.members for r in reps})
        if foreign:
            raise ValueError(f"study {name}: not_run seeds {foreign} of {'@'.join(cell)} are not seeds it runs")
    if study.pool is not None and (study.pool < 1 or max(study.members) >= study.pool):
        raise ValueError(f"study {name}: unit.pool {study.pool} must exceed every member id (run seed mod pool)")
    for arm in study.arms.values():
        for lv in study.levels.values():
            if lv.lr and arm.ref not in lv.lr:
                raise ValueError(
                    f"study {name}: level {lv.name} sets lr for {sorted(lv.lr)}, arm {arm.name} has ref {arm.ref!r}"
                )
    if study.match is not None:
        names = {c.name for c in study.contrasts}
        unknown_match = sorted(
            {*study.match.contrasts, *([study.match.placebo] if study.match.placebo else [])} - names
        )
        if unknown_match:
            raise ValueError(f"study {name}: match names contrasts it does not declare: {unknown_match}")
    if d.margin_relative is not None and not 0 < d.margin_relative < 1:
        raise ValueError(f"study {name}: design.margin_relative {d.margin_relative} must be a share in (0, 1)")
    if list(d.looks) != sorted(set(d.looks)):
        raise ValueError(f"study {name}: looks {list(d.looks)} must increase")
    if d.looks[0] < MIN_STARTS and study.as_ran is None:  # as ran: the rule reads no look under MIN_STARTS
        raise ValueError(
            f"study {name}: its first look at {d.looks[0]} starts has next to no power at the level it spends (a t on "
            f"start means with one degree of freedom); look first at {MIN_STARTS} starts or more"
        )
    if d.looks[-1] > len(study.members):
        raise ValueError(
            f"study {name}: its last look needs {d.looks[-1]} starts but unit.members draws {len(study.members)}"
        )
    if not 0 < d.alpha < 0.5 or not 0 < d.power < 1 or d.mde <= 0:
        raise ValueError(f"study {name}: alpha {d.alpha}, power {d.power}, mde {d.mde} out of range")
    _check_duplicates(study)  # two cells composing to one run config: refused unless declared (`duplicates`)
    if study.as_ran is None:
        _check_sweeps(study)  # one run per seed and cell: no axis of the preset's sweep left open


def _check_sweeps(study: Study) -> None:
    """Refuse a cell whose overrides leave an axis of its preset's own sweep (`hydra.sweeper.params`, less `seed`,
    which the launcher sets) unset: its multirun would run every value of that axis under the cell's name, a mix of
    configs read as one arm, at that many times the declared cost."""
    preset = study.file.parent.parent / "preset" / f"{study.preset}.yaml"
    if not preset.is_file():
        return
    raw = yaml.safe_load(preset.read_text()) or {}
    params = ((raw.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    axes = [str(k).lstrip("+") for k in params if str(k).lstrip("+") != "seed"]
    for cell in study.cells():
        given = {o.lstrip("~+").partition("=")[0] for o in study.run_overrides(*cell)}
        open_axes = [a for a in axes if a not in given]
        if open_axes:
            raise ValueError(
                f"study {study.name}: cell {'@'.join(cell)} leaves {open_axes} of preset {study.preset}'s sweep "
                f"unset, so its multirun would run every value of each under one cell; set them in the study's, "
                "the arm's or the level's overrides"
            )


def studies_folder(presets: str | Path) -> Path:
    """The folder of declarations beside a presets folder (experiments/conf/study beside experiments/conf/preset)."""
    return Path(presets).parent / "study"


def declaration(name: str, presets: str | Path) -> Path:
    """The declaration of study `name` beside a presets folder (it may not exist: a presets folder of another
    checkout)."""
    return studies_folder(presets) / f"{name}.yaml"


def is_study(path: Path) -> bool:
    """Whether the declaration at `path` is a study (it declares arms), not a results folder its presets filled."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return True  # refused on its load, naming the line
    return not isinstance(raw, dict) or "arms" in raw


def study_files(folder: str | Path) -> list[Path]:
    """The declarations of studies in `folder` (those with arms), by name."""
    return [p for p in sorted(Path(folder).glob("*.yaml")) if is_study(p)]


def study_path(name: str, folder: Path) -> Path:
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = [p.stem for p in study_files(folder)]
        raise ValueError(f"no study {name!r} in {folder}: declared studies are {known}")
    return path


# Duplicate cells (`duplicates:` in a declaration): two cells that compose to one run config run the same runs twice.


def _check_duplicates(study: Study) -> None:
    """Refuse cells the study runs that compose to one run config unless one `duplicates` group names them all, and
    a group that names a cell the study does not run."""
    declared = _declared_duplicates(study)
    ran = set(study.cells())
    for cells, _ in declared:
        stray = [f"{a}@{lv}" for a, lv in cells if (a, lv) not in ran]
        if stray:
            raise ValueError(f"study {study.name}: duplicates names cells it does not run: {stray}")
    for group in _same_config(study):
        if not any(set(group) <= set(cells) for cells, _ in declared):
            named = [f"{a}@{lv}" for a, lv in group]
            listed = f"{', '.join(named[:-1])} and {named[-1]}"
            raise ValueError(
                f"study {study.name}: cells {listed} compose to the same run config, so their runs inform nothing "
                "one of them does not: run one, or declare them under `duplicates` with the reason they all run"
            )


def _declared_duplicates(study: Study) -> list[tuple[tuple[tuple[str, str], ...], str]]:
    """The declaration's `duplicates`: a list of {cells: [arm@level, ...] (two or more), reason: why they run},
    each group as (its cells, its reason); [] where the declaration names none (or is not a file)."""
    raw = yaml.safe_load(study.file.read_text()) if study.file.is_file() else None
    groups = (raw or {}).get("duplicates") if isinstance(raw, dict) else None
    if groups is None:
        return []
    if not isinstance(groups, list):
        raise ValueError(f"study {study.name}: duplicates must be a list of {{cells: [arm@level, ...], reason: ...}}")
    out = []
    for group in groups:
        if (
            not isinstance(group, dict)
            or set(group) != {"cells", "reason"}
            or not isinstance(group["cells"], list)
            or len(set(map(str, group["cells"]))) < 2
            or not str(group["reason"] or "").strip()
        ):
            raise ValueError(
                f"study {study.name}: duplicates entry {group!r} must be {{cells: [arm@level, ...] (two or more), "
                "reason: why they all run}"
            )
        cells = tuple(dict.fromkeys(_cell(str(c), study.name) for c in group["cells"]))
        out.append((cells, " ".join(str(group["reason"]).split())))
    return out


def _same_config(study: Study) -> list[list[tuple[str, str]]]:
    """The groups (two cells or more, in run order) of the cells the study runs that compose to one run config: each
    cell's run overrides (`Study.run_overrides`) expanded through the config groups of the declaration's Hydra
    config folder (the folder above its own, where it holds config.yaml) and flattened, later values over earlier
    ones, keys that do not change what a run computes (`moe_rl.run.identity.NOT_IDENTITY`) left out. Outside a
    config folder the overrides alone are compared, a group choice as a key."""
    conf = study.file.parent.parent
    composer = _Composer(conf if (conf / "config.yaml").is_file() else None)
    groups: dict[tuple, list[tuple[str, str]]] = {}
    for cell in study.cells():
        groups.setdefault(composer.identity(study.run_overrides(*cell)), []).append(cell)
    return [cells for cells in groups.values() if len(cells) > 1]


_DELETED = object()  # a `~key` override: the key (or group) left out


def _scalar(value: object) -> object:
    """A config leaf as compared: numbers spelled as strings (`1e-3`, which YAML 1.1 reads as text) as floats."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if isinstance(value, list):
        return tuple(_scalar(v) for v in value)
    return value


def _flat(body: object, prefix: str, out: dict[str, object]) -> None:
    """Merge `body` into the flattened config `out` at `prefix` (dicts merge key by key; anything else replaces)."""
    if isinstance(body, dict):
        if not body and prefix and not any(k.startswith(prefix + ".") for k in out):
            out[prefix] = "{}"  # an empty mapping where there was none: a key of its own
        elif body:
            out.pop(prefix, None)
        for k, v in body.items():
            _flat(v, f"{prefix}.{k}" if prefix else str(k), out)
        return
    for key in [k for k in out if k.startswith(prefix + ".")]:
        del out[key]
    out[prefix] = _scalar(body)


_Config = tuple[bool, list, dict]  # (its package is _global_, its defaults list, its body)


class _Composer:
    """A run config as Hydra composes it from a config folder, flattened (dotted keys): the primary config's
    defaults, each chosen group file (its defaults, then its body, at its package), the configs a `+group=x`
    override adds, the defaults lists' `override /group: x` and the command line's `group=x` choices, then the
    command line's values. Interpolations stay text; the structured base config, the same for every run, is left
    out."""

    def __init__(self, conf: Path | None) -> None:
        self.conf = conf
        self.files: dict[Path, _Config] = {}

    def is_group(self, key: str) -> bool:
        return self.conf is not None and "." not in key and (self.conf / key).is_dir()

    def load(self, path: Path) -> _Config:
        if path not in self.files:
            text = path.read_text()
            body = yaml.safe_load(text) or {}
            defaults = list(body.pop("defaults", None) or [])
            body.pop("hydra", None)
            self.files[path] = ("# @package _global_" in text.split("\n", 1)[0], defaults, body)
        return self.files[path]

    def expand(
        self,
        group: str,
        config: _Config,
        choices: dict[str, object],
        found: dict[str, object],
        layers: list[tuple[str, object]],
    ) -> None:
        """Append the layers (prefix, body) of `config` of `group` in composition order, the configs its defaults
        list chooses (or `choices` chooses for their group) first; record its list's overrides in `found`."""
        assert self.conf is not None
        is_global, defaults, body = config
        entries: list[tuple[str, str] | None] = []  # None: its own body
        for item in defaults:
            if item == "_self_":
                entries.append(None)
            elif isinstance(item, str):
                entries.append((group, item))  # a config of its own group
            elif isinstance(item, dict):
                for raw_key, value in item.items():
                    key = str(raw_key).replace("optional ", "").strip()
                    if key.startswith("override "):
                        found[key.removeprefix("override ").strip().lstrip("/")] = str(value)
                    elif key.startswith("/") or not group or not (self.conf / group / key).is_dir():
                        entries.append((key.lstrip("/"), str(value)))
                    else:
                        entries.append((f"{group}/{key}", str(value)))
        if None not in entries:
            entries.append(None)  # Hydra >= 1.1: a config's own values after its defaults
        for entry in entries:
            if entry is None:
                layers.append(("" if is_global or not group else group.replace("/", "."), body))
                continue
            sub, choice = entry
            chosen = choices.get(sub, choice)
            path = self.conf / sub / f"{chosen}.yaml"
            if chosen is not _DELETED and not sub.startswith("hydra") and path.is_file():  # else the base config
                self.expand(sub, self.load(path), choices, found, layers)

    def identity(self, overrides: list[str]) -> tuple[tuple[str, str], ...]:
        """The config `overrides` compose to, as sorted (dotted key, value) pairs, less the keys that do not change
        what a run computes."""
        from moe_rl.run.identity import NOT_IDENTITY

        added: list[dict[str, str]] = []  # `+group=x`: appended to the primary's defaults in order
        cli_choices: dict[str, object] = {}
        values: list[tuple[str, object]] = []
        for override in overrides:
            text = override.strip()
            deleting = text.startswith("~")
            key, _, value = text.lstrip("~+").partition("=")
            if key.startswith("hydra"):
                continue
            if self.is_group(key):
                if text.startswith("+"):
                    added.append({key: value})
                cli_choices[key] = _DELETED if deleting else value
            else:
                values.append((key, _DELETED if deleting else yaml.safe_load(value) if value else value))
        flat: dict[str, object] = {}
        if self.conf is None:
            flat.update(cli_choices)
        else:
            _, defaults, body = self.load(self.conf / "config.yaml")
            primary: _Config = (True, [*defaults, *added], body)
            found: dict[str, object] = {}
            layers: list[tuple[str, object]] = []
            for _ in range(4):  # a defaults list's override can choose a config whose list overrides more
                layers = []
                seen: dict[str, object] = {}
                self.expand("", primary, {**found, **cli_choices}, seen, layers)
                if seen == found:
                    break
                found = seen
            for prefix, layer in layers:
                _flat(layer, prefix, flat)
        for dotted, setting in values:
            if setting is _DELETED:
                for k in [k for k in flat if k == dotted or k.startswith(dotted + ".")]:
                    del flat[k]
            else:
                _flat(setting, dotted, flat)
        return tuple(sorted((k, repr(v)) for k, v in flat.items() if k.split(".")[0] not in NOT_IDENTITY))
