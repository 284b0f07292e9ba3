"""The cost ledger: what the declared studies cost in CPU-minutes, per study, per run, per start and per decided
claim, and where it went: pilots, warm-ups, runs, and the runs of looks after which no verdict moved.

Read from the records the runs left, so today's figure is reproducible from the shipped results:
- a run's cost is its status.json `wall_s`. Every study runs each run on one torch thread (`threads=1`, its
  workers side by side), so a run's wall seconds are taken as its CPU seconds (`ASSUMPTION`, printed with the
  ledger). `wall_s` is the run's loop alone: its warm-up, loaded or trained before the loop starts, is not in it;
- a warm-up is counted by its key (meta.json's `cold_start.key`: one per pool member and recipe, shared by every
  run and pilot that starts from it) with its SFT steps. Its records (meta.json's `cold_start`, the cache's
  cold_start.json) carry no time, so a warm-up is priced only at a given `warmup_s` and otherwise reported as not
  timed, never guessed;
- a pilot is any run under the study's `pilot*` folders, priced as a run;
- "after settled": the runs of the pool members of the looks read after the look from which every verdict of the
  study already equalled its final one (`settled_look`; the verdicts at each look are the study side's:
  `moe_rl.studies.ledger`). A subset of the runs' share, not a fourth part.

Per start: the runs' cost (and the warm-ups', where priced) over the pool members the runs started from. Per
decided claim: the study's whole cost (pilots, warm-ups where priced, runs) over the claims it decided (a claim
id counts once per study however many of its contrasts decided it; over all studies, once).

Pure: `records` reads run folders; the rest is arithmetic on `StudyCost` (`ledger_table`) and its text
(`ledger_lines`). Torch-free, like all of `moe_rl.analysis`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from moe_rl.analysis.configs import run_meta
from moe_rl.analysis.power import run_wall_s

ASSUMPTION = (
    "one thread per run (threads=1): a run's wall_s (status.json) is taken as its CPU seconds; warm-ups are not in "
    "any run's wall_s"
)
NOT_TIMED = (
    "warm-ups: their records (meta.json `cold_start`, the cache's cold_start.json) carry steps and accuracies but no "
    "time, so they are counted, not timed, and left out of every CPU figure (--warmup-s S prices each at S seconds)"
)


@dataclass(frozen=True)
class Record:
    """One run folder's cost: its wall seconds (status.json `wall_s`; NaN where unread), its run seed (None where
    meta.json records none) and the warm-up it started from (`cold_start.key`; None: none, or a checkpoint as it
    is) with that warm-up's SFT steps."""

    run_dir: Path
    seconds: float
    seed: int | None
    warmup: str | None
    sft_steps: int = 0
    threads: int | None = None  # config.yaml's `threads` (None: not recorded)


THREADS = re.compile(r"^threads:\s*(\d+)\s*$", re.M)  # a run's torch threads, read without parsing its config


def run_threads(run_dir: Path) -> int | None:
    """The torch threads a run's config.yaml sets (`threads`); None without the file or the key."""
    path = run_dir / "config.yaml"
    found = THREADS.search(path.read_text()) if path.is_file() else None
    return int(found.group(1)) if found else None


def records(folder: Path) -> list[Record]:
    """Every run folder (one holding a status.json) under `folder`, at any depth, in path order; [] where the folder
    does not exist."""
    out = []
    for status in sorted(Path(folder).rglob("status.json")):
        run_dir = status.parent
        meta = run_meta(run_dir)
        cold = meta.get("cold_start") or {}
        key = cold.get("key")
        warmup = None if key is None or str(key).startswith("checkpoint:") else str(key)
        seed, steps = meta.get("seed"), int(cold.get("steps") or 0) if warmup else 0
        seed = None if seed is None else int(seed)
        out.append(Record(run_dir, run_wall_s(run_dir), seed, warmup, steps, run_threads(run_dir)))
    return out


def seconds(recs: Iterable[Record]) -> float:
    """The records' wall seconds, those unread (NaN) left out."""
    return math.fsum(r.seconds for r in recs if math.isfinite(r.seconds))


def warmups(recs: Iterable[Record]) -> dict[str, int]:
    """The distinct warm-ups the records started from: key -> SFT steps."""
    return {r.warmup: r.sft_steps for r in recs if r.warmup is not None}


def settled_look(by_look: Sequence[Sequence[str]]) -> int:
    """The look (from 1) from which every later look's verdicts equal the last look's: the look after which no
    verdict moved (`by_look[j]`: the verdicts of every contrast at look j + 1, the last the final ones); 0 where no
    look was read."""
    if not by_look:
        return 0
    final, j = list(by_look[-1]), len(by_look)
    while j > 1 and list(by_look[j - 2]) == final:
        j -= 1
    return j


def members_after(members: Sequence[int], looks: Sequence[int], settled: int, reached: int) -> frozenset[int]:
    """The pool members of the looks read after look `settled` (members[looks[settled-1]:looks[reached-1]])."""
    if settled < 1 or reached <= settled:
        return frozenset()
    return frozenset(members[looks[settled - 1] : looks[reached - 1]])


@dataclass(frozen=True)
class StudyCost:
    """A declared study's records and what its verdicts say of them."""

    name: str
    runs: tuple[Record, ...]  # under results/<study>/runs
    pilots: tuple[Record, ...]  # under results/<study>/pilot* and, matched per start, probes/
    pool: int  # run seed s starts from pool member s mod pool
    claims: tuple[str, ...]  # the claim ids its contrasts decide (not exploratory), declaration order
    decided: tuple[str, ...]  # those whose verdict is reproduced or not reproduced
    after: frozenset[int] = frozenset()  # pool members of the looks read after its verdicts settled
    settled: str = ""  # how its verdicts settled, in words ("look 2 of 3, 3 read")
    note: str = ""  # why it has no verdicts ("": it has)
    geometry: str = ""  # matched by probes: the model its reference arm ran ("": not matched by probes)

    def members(self) -> set[int]:
        """The pool members its runs started from."""
        return {r.seed % self.pool for r in self.runs if r.seed is not None}

    def after_runs(self) -> list[Record]:
        return [r for r in self.runs if r.seed is not None and r.seed % self.pool in self.after]


COLUMNS = (
    "study",
    "runs",
    "starts",
    "pilot_runs",
    "warmups",
    "sft_steps",
    "run_min",
    "pilot_min",
    "warmup_min",
    "total_min",
    "per_run_min",
    "per_start_min",
    "claims",
    "decided",
    "decided_claims",
    "per_claim_min",
    "pilot_share",
    "warmup_share",
    "run_share",
    "after_min",
    "after_share",
    "settled",
    "unread",
    "threaded",
)


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _row(
    name: str,
    runs: Sequence[Record],
    pilots: Sequence[Record],
    starts: int,
    warm: dict[str, int],
    claims: int,
    decided: Sequence[str],
    after: Sequence[Record],
    settled: str,
    warmup_s: float | None,
) -> dict[str, object]:
    run_min, pilot_min = seconds(runs) / 60, seconds(pilots) / 60
    warmup_min = math.nan if warmup_s is None else len(warm) * warmup_s / 60
    total = run_min + pilot_min + (0.0 if warmup_s is None else warmup_min)
    return {
        "study": name,
        "runs": len(runs),
        "starts": starts,
        "pilot_runs": len(pilots),
        "warmups": len(warm),
        "sft_steps": sum(warm.values()),
        "run_min": run_min,
        "pilot_min": pilot_min,
        "warmup_min": warmup_min,
        "total_min": total,
        "per_run_min": _ratio(run_min, len(runs)),
        "per_start_min": _ratio(run_min + (0.0 if warmup_s is None else warmup_min), starts),
        "claims": claims,
        "decided": len(decided),
        "decided_claims": ", ".join(decided),
        "per_claim_min": _ratio(total, len(decided)),
        "pilot_share": _ratio(pilot_min, total),
        "warmup_share": _ratio(warmup_min, total),
        "run_share": _ratio(run_min, total),
        "after_min": seconds(after) / 60,
        "after_share": _ratio(seconds(after) / 60, total),
        "settled": settled,
        "unread": sum(not math.isfinite(r.seconds) for r in (*runs, *pilots)),
        "threaded": sum(r.threads is not None and r.threads != 1 for r in (*runs, *pilots)),
    }


def ledger_table(costs: Sequence[StudyCost], warmup_s: float | None = None) -> pd.DataFrame:
    """One row per study (`COLUMNS`; minutes are CPU-minutes, shares of the study's total), then `all`: every study
    together, a warm-up shared by two studies and a claim decided by two counted once, `deciding`: the studies
    that decided at least one claim, and `matched by probes: <model>`: per model, the studies matched by probes (per
    start or over the pool: probes, a placebo, futility stops, the verdict engine's design). `warmup_s`: the seconds
    one warm-up is priced at (None: not timed, NaN)."""
    rows = []
    for c in costs:
        warm = warmups((*c.runs, *c.pilots))
        rows.append(
            _row(
                c.name,
                c.runs,
                c.pilots,
                len(c.members()),
                warm,
                len(c.claims),
                c.decided,
                c.after_runs(),
                c.settled or c.note,
                warmup_s,
            )
        )
    matched = [
        (f"matched by probes: {g}", [c for c in costs if c.geometry == g])
        for g in dict.fromkeys(c.geometry for c in costs if c.geometry)
    ]
    for name, chosen in (("all", costs), ("deciding", [c for c in costs if c.decided]), *matched):
        decided = list(dict.fromkeys(claim for c in chosen for claim in c.decided))
        rows.append(
            _row(
                name,
                [r for c in chosen for r in c.runs],
                [r for c in chosen for r in c.pilots],
                sum(len(c.members()) for c in chosen),
                warmups(r for c in chosen for r in (*c.runs, *c.pilots)),
                len({claim for c in chosen for claim in c.claims}),
                decided,
                [r for c in chosen for r in c.after_runs()],
                "",
                warmup_s,
            )
        )
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _min(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{x:.1f}"


def _share(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{100 * x:.0f}%"


def ledger_lines(table: pd.DataFrame, root: Path, timed: bool) -> list[str]:
    """The ledger as text: what it counts, one row per study and the two totals, then the headline."""
    lines = [
        f"Cost ledger of the declared studies under {root} (CPU-minutes, from the runs' own records)",
        f"- assumption: {ASSUMPTION}",
        "- " + ("warm-ups: priced at --warmup-s each" if timed else NOT_TIMED),
        "- per start: runs (and warm-ups, where priced) over the pool members they started from; per decided claim: "
        "the study's pilots, warm-ups (where priced) and runs over the claims it decided (reproduced or not "
        "reproduced; a claim once per study, and once in `all`)",
        "- after settled: runs of the looks read after the look from which no verdict moved (part of `runs`)",
        "",
        "| study | runs | starts | CPU-min | per run | per start | decided claims | per decided claim "
        "| pilots | warm-ups | runs | after settled | verdicts settled at |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for _, r in table.iterrows():
        decided = f"{r['decided']} of {r['claims']}" + (f" ({r['decided_claims']})" if r["decided_claims"] else "")
        warm = (
            f"{_share(r['warmup_share'])} ({r['warmups']})"
            if timed
            else f"not timed ({r['warmups']}, {r['sft_steps']} SFT steps)"
        )
        total = r["study"] in ("all", "deciding") or str(r["study"]).startswith("matched by probes: ")
        name = f"**{r['study']}**" if total else r["study"]
        lines.append(
            f"| {name} | {r['runs']} | {r['starts']} | {_min(r['total_min'])} | {r['per_run_min']:.2f} "
            f"| {_min(r['per_start_min'])} | {decided} | {_min(r['per_claim_min'])} "
            f"| {_share(r['pilot_share'])} ({r['pilot_runs']}) | {warm} | {_share(r['run_share'])} "
            f"| {_share(r['after_share'])} ({_min(r['after_min'])}) | {r['settled'] or '—'} |"
        )
    every = table[table["study"] == "all"].iloc[0]
    if every["unread"]:
        lines.append(f"\n{every['unread']} run folders have no readable wall_s: left out of every figure.")
    if every["threaded"]:
        lines.append(
            f"\n{every['threaded']} run(s) set more than one torch thread (config.yaml `threads`): their wall_s "
            "understates their CPU time."
        )
    lines.append("")
    lines.append(headline(table, timed))
    return lines


def headline(table: pd.DataFrame, timed: bool) -> str:
    """The total line: CPU-minutes per decided claim over all declared studies (and over those that decided one)."""
    every = table[table["study"] == "all"].iloc[0]
    deciding = table[table["study"] == "deciding"].iloc[0]
    what = "pilots, warm-ups and runs" if timed else "pilots and runs; warm-ups not timed"
    matched = table[table["study"].astype(str).str.startswith("matched by probes: ")]
    per_model = "".join(
        f"; matched by probes on {str(r['study']).removeprefix('matched by probes: ')}: {_min(r['per_claim_min'])} "
        f"({_min(r['total_min'])} CPU-min / {r['decided']})"
        for _, r in matched.iterrows()
    )
    return (
        f"CPU-minutes per decided claim over all declared studies: {_min(every['per_claim_min'])} "
        f"({_min(every['total_min'])} CPU-min of {what} / {every['decided']} decided claims: "
        f"{every['decided_claims'] or 'none'}); over the studies that decided one: "
        f"{_min(deciding['per_claim_min'])} ({_min(deciding['total_min'])} CPU-min){per_model}"
    )
