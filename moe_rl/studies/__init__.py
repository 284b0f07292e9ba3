"""The shipped studies: one row each in `STUDIES`, in page order (the main job first).

A study is a results folder, the presets whose runs it holds, the question it answers, its report (None: the
folder report of `moe_rl.analysis.folder_report`, by arm), the claims it decides and the folders its report
borrows runs from. A study's own analysis, report and claims live in its modules here (`frontier`,
`frontier_report`, `frontier_claims`, ...); `moe_rl.analysis` is the generic toolkit they build on. A new
study is its declaration (experiments/conf/study/NAME.yaml, `design`; run by `experiments/study.py NAME`) and one
row below whose report is `declared_report.study_report(NAME)` and whose claims are `declared_claims.study_claim(...)`: the one
rule decides them (`declared`). Older studies keep their own modules here (an analysis, a report, claims); the
frontier's bisection keeps its own launcher (experiments/frontier.py). A table in README.md: `readme` in a
declaration, else a block in `moe_rl.report.README_TABLES`.

The presets folder is passed in (`python -m moe_rl.report --presets`, default experiments/conf/preset): nothing
here reads the checkout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from moe_rl.analysis.claims import Claim, ClaimItem, PairedClaim, evaluate_claims
from moe_rl.analysis.folder_report import StudyReport, with_provenance
from moe_rl.analysis.pages import write_claims_page
from moe_rl.analysis.provenance import run_records
from moe_rl.studies import (
    declared_claims,
    declared_report,
    divergence_report,
    drift_claims,
    drift_report,
    engine,
    forecast_report,
    frontier,
    frontier_claims,
    frontier_report,
    ladder,
    mechanism,
    mechanism_claims,
    phase,
    premise,
    shift,
    stabilizers,
)


def _expert_drift(root: Path, presets: Path) -> Claim:
    """Claim 1 (drift_claims.claim_expert_drift) reads no preset."""
    return drift_claims.claim_expert_drift(root)


def _shift_leads(root: Path, presets: Path) -> Claim:
    """Claim 6 (shift.claim_shift_leads) reads no preset."""
    return shift.claim_shift_leads(root)


def _paired(claim: PairedClaim) -> Callable[[Path, Path], Claim]:
    """A paired claim's verdict on the shipped folders, as a function of (root, presets): an earlier look."""

    def judge(root: Path, presets: Path) -> Claim:
        return evaluate_claims(root, {claim.id: claim}, presets)[0]

    return judge


@dataclass(frozen=True)
class ResultsFolder:
    """One results folder: what it asks, which presets fill it, how it is reported and what it decides."""

    folder: str  # results/<folder>
    presets: tuple[str, ...]  # experiments/conf/preset/<name>.yaml whose runs it holds (their `experiment` key)
    question: str
    report: StudyReport | None = None  # (runs_dir, out, presets) -> files; None: the folder report by arm
    claims: Mapping[int, ClaimItem] = field(default_factory=dict)  # the claims it decides, by id
    borrows: tuple[str, ...] = ()  # folders beside it whose runs its report also reads
    claims_section: Callable[[Path, Path], list[str]] | None = None  # (root, presets) -> its section of CLAIMS.md
    history: str = ""  # a superseded sweep or a pilot kept as history: by what, and why ("" where current)


_MECHANISM_REPORT = with_provenance(mechanism.write_mechanism_report)
STUDIES: tuple[ResultsFolder, ...] = (
    ResultsFolder(
        "compare",
        ("compare",),
        "The main job: does R2 or a sequence-level ratio keep routing and training stable? GRPO+R2, GRPO, GSPO, "
        "GSPO+R2, one run of each from each of 5 cold starts.",
    ),
    ResultsFolder(
        "phase",
        ("phase", "phase_band", "phase_edge"),
        "Where does GRPO without replay break? grpo+none, grpo+r2 and gspo+none over lr x N, with the edge cell "
        "and the band where collapse is a coin flip seeded further; does router shift lead clip bursts?",
        claims={6: _shift_leads},
    ),
    ResultsFolder(
        "offpolicy_replay",
        ("offpolicy_replay",),
        "Claims 2 and 3 at one off-policy cell where grpo+none degrades without reaching the floor (lr 2.5e-4, "
        "N = 8), declared (experiments/conf/study/offpolicy_replay.yaml) with its power, looks and new pool "
        "members: GRPO + R2 and GSPO against GRPO without replay.",
        report=declared_report.study_report("offpolicy_replay"),
        history="grpo+none did not degrade there on new starts (claims 2 and 3 untestable); re-placed by offpolicy_edge",
    ),
    ResultsFolder(
        "offpolicy_edge",
        ("offpolicy_edge",),
        "Claims 2 and 3 at the off-policy cell a pilot across starts placed (lr 4e-4, N = 8: grpo+none loses on "
        "average, most runs above the floor), declared (experiments/conf/study/offpolicy_edge.yaml) on new pool "
        "members: GRPO + R2 and GSPO against GRPO without replay.",
        report=declared_report.study_report("offpolicy_edge"),
        claims={
            2: declared_claims.study_claim(
                2,
                "offpolicy_edge",
                "r2_minus_none",
                declared_claims.study_claim(2, "offpolicy_replay", "r2_minus_none", _paired(phase.OFFPOLICY_GRPO)),
            ),
            3: declared_claims.study_claim(
                3,
                "offpolicy_edge",
                "gspo_minus_grpo_none",
                declared_claims.study_claim(3, "offpolicy_replay", "gspo_minus_grpo_none", _paired(phase.GSPO_STABLE)),
            ),
        },
    ),
    ResultsFolder(
        "phase_mixtral",
        ("phase_mixtral",),
        "Does the phase map's edge hold for Mixtral's routing rule (softmax over the selected top-2)?",
    ),
    ResultsFolder(
        "phase_mismatch",
        ("phase_mismatch",),
        "With bf16 rollouts and N = 8, does R3 keep GRPO more stable than R2?",
        history="emulated bf16 rollouts; superseded by engine_mismatch, on the engine's own bf16 kernels",
    ),
    ResultsFolder(
        "offpolicy",
        ("offpolicy",),
        "How do flips, ratio variance and collapses grow with updates per rollout N in {1, 2, 4, 8}?",
    ),
    ResultsFolder(
        "stress",
        ("stress",),
        "With large, stale updates (lr 3e-4, N = 8), does GRPO without replay collapse where R2 or GSPO hold?",
        history="one cell of 3 seeds; superseded by phase, which maps lr x N",
    ),
    ResultsFolder(
        "mismatch",
        ("mismatch",),
        "With bfloat16 rollouts and float32 training, does R3 beat R2 and none?",
        history="emulated bf16 rollouts, 3 seeds; superseded by engine_mismatch",
    ),
    ResultsFolder(
        "engine_phase",
        ("engine_phase",),
        "Where does the engine model (vLLM bfloat16 rollouts) break? A pilot scan of grpo+none over lr x N.",
        history="the pilot that placed engine_mismatch's cells",
    ),
    ResultsFolder(
        "engine_mismatch",
        ("engine_mismatch", "engine_mismatch_gentle"),
        "With real engine rollouts (vLLM, bfloat16) and float32 training, where GRPO breaks, does R3 on the "
        "engine's own routes beat R2, and do the engine-gap corrections TIS and IcePop help?",
        history="16 seed pairs of one cold start, most runs at accuracy 0; claim 5 re-read by engine_gap",
    ),
    ResultsFolder(
        "engine_gap",
        ("engine_gap",),
        "Claim 5 on new pool members: R3 against R2 with vLLM bfloat16 rollouts at N = 8 and lr 4e-4, where a pilot "
        "across starts found GRPO with R2 degrading with most runs above the floor, declared "
        "(experiments/conf/study/engine_gap.yaml) with its power and looks.",
        report=declared_report.study_report("engine_gap"),
        claims={5: declared_claims.study_claim(5, "engine_gap", "r3_minus_r2", _paired(engine.R3_VS_R2))},
    ),
    ResultsFolder(
        "engine_mismatch_stable",
        ("engine_mismatch_stable",),
        "The first engine sweep, kept as the stable reference: grpo+none/r2/r3 where every run ends above its "
        "cold start.",
        history="a cell where nothing degrades; superseded by engine_mismatch, where GRPO breaks",
    ),
    ResultsFolder(
        "drift_scaling",
        ("drift_scaling", "drift_scaling_depth"),
        "How does per-update drift scale with experts, top-k, MoE depth and lr, and where does the GSPO paper's "
        "~10% begin?",
        report=with_provenance(drift_report.write_folder_report),
    ),
    ResultsFolder(
        "depth_drift",
        ("depth_drift",),
        "Claim 4 on new pool members: the off-policy flip rate per MoE layer of a model with 8 MoE layers against one "
        "with 2, at the drift_scaling centre, each depth with a warm-up of its own per member, declared "
        "(experiments/conf/study/depth_drift.yaml) with its power and looks from a pilot across starts.",
        report=declared_report.study_report("depth_drift"),
        claims={4: declared_claims.study_claim(4, "depth_drift", "deep_minus_shallow", drift_claims.claim_depth)},
    ),
    ResultsFolder(
        "drift_forecast",
        ("drift_forecast",),
        "Is the per-update flip rate one curve of margin / router-logit movement across E, k, L and lr?",
        report=with_provenance(forecast_report.write_folder_report),
        claims={1: _expert_drift},
    ),
    ResultsFolder(
        "dense_control",
        ("dense_control",),
        "Is the instability at this scale specific to MoE? The dense control next to the MoE model, each from "
        "its own cold start, in two cells where the MoE model degrades (claim 7's first look; the causal study "
        "re-decides it at matched divergence).",
        history="claim 7's first look, at unmatched divergence; superseded by causal",
    ),
    ResultsFolder(
        "mechanism",
        ("mechanism",),
        "What in the MoE model breaks where its dense control holds (lr 3e-4, N = 8)? A ladder of rungs from "
        "matched starts, each changing one difference between the two.",
        report=_MECHANISM_REPORT,
    ),
    ResultsFolder(
        "router_defaults",
        ("router_defaults",),
        "Claims 8 and 9 at the causal study's `past` cell, declared (experiments/conf/study/router_defaults.yaml) "
        "with its power, looks and new pool members: the family's load-balancing loss and a frozen router against "
        "a learning router without it.",
        report=declared_report.study_report("router_defaults"),
        claims={
            8: declared_claims.study_claim(8, "router_defaults", "aux_minus_moe", _paired(mechanism_claims.AUX_HURTS)),
            9: declared_claims.study_claim(
                9, "router_defaults", "frozen_minus_moe", _paired(mechanism_claims.FROZEN_ROUTER)
            ),
        },
    ),
    ResultsFolder(
        "mechanism_gentle",
        ("mechanism_gentle",),
        "Does the ladder read the same at a gentler cell (lr 3e-4, N = 4), where the MoE model degrades less?",
        report=_MECHANISM_REPORT,
    ),
    ResultsFolder(
        "mechanism_fine",
        ("mechanism_fine",),
        "Does the MoE-specific gap hold with many small experts (64 experts, top-8)?",
        report=_MECHANISM_REPORT,
    ),
    ResultsFolder(
        "stabilizers",
        ("stabilizers",),
        "Does any published stabilizer keep GRPO from degrading where it degrades? A leaderboard against grpo+none.",
        report=stabilizers.write_stabilizers_report,
        borrows=(stabilizers.BORROWS[0],),
        claims_section=stabilizers.claims_section,
    ),
    ResultsFolder(
        "frontier",
        ("frontier",),
        "Where does each method stop being stable? Each arm's edge along lr and along staleness N, by bisection.",
        report=with_provenance(frontier_report.write_frontier_report),
        borrows=tuple(s for s in frontier.SOURCES if s != "frontier"),
        claims_section=frontier_report.claims_section,
    ),
    ResultsFolder(
        "divergence",
        ("divergence",),
        "At equal per-update divergence, which methods stay stable? Each method's accuracy change against its "
        "realised per-update KL over three lrs, from a pool of 6 cold starts; the KL where each crosses -5 pp, and "
        "whether lr^2 x N sets the outcome.",
        report=declared_report.study_report("divergence"),
        claims_section=divergence_report.claims_section,
    ),
    ResultsFolder(
        "staleness",
        ("staleness",),
        "Do the staleness claims hold on the axes their papers use? VESPO's rollout staleness S (one pass over an "
        "S-fold rollout) and an asynchronous lag k, 192 updates per run, from a pool of 6 cold starts.",
        report=declared_report.study_report("staleness"),
        history="6 starts at the pool the earlier studies shared; claims 10 and 11 re-read by staleness_erosion",
    ),
    ResultsFolder(
        "staleness_erosion",
        ("staleness_erosion",),
        "Claims 10 and 11 on the erosion from S = 1 to S = 24, declared (experiments/conf/study/staleness_erosion.yaml) "
        "with its power, looks and new pool members: VESPO against SAPO, the losses without a trust region against "
        "those with one.",
        report=declared_report.study_report("staleness_erosion"),
        claims={
            10: declared_claims.study_claim(
                10,
                "staleness_erosion",
                "vespo_vs_sapo_erosion",
                declared_claims.study_claim(
                    10, "staleness", "vespo_vs_sapo_erosion", frontier_claims.claim_vespo_staleness
                ),
            ),
            11: declared_claims.study_claim(
                11,
                "staleness_erosion",
                "no_trust_region_vs_trust_region_erosion",
                declared_claims.study_claim(
                    11, "staleness", "no_trust_region_vs_trust_region_erosion", frontier_claims.claim_no_trust_region
                ),
            ),
        },
    ),
    ResultsFolder(
        "causal",
        ("causal",),
        "Is route drift a cause of the MoE model's degradation, and is the sparse expert step? Anchored routing and a "
        "load-aware expert step in a 2 x 2, width- and lr-matched dense controls, at two per-update KL levels, from "
        "a pool of 6 cold starts per model x 2 seeds.",
        report=declared_report.study_report("causal"),
        history="6 starts x 2 seeds at unmatched acting KL; claims 14, 15 and 7 re-read by causal_matched",
    ),
    ResultsFolder(
        "causal_matched",
        ("causal_matched",),
        "Claims 14, 15 and 7 at the causal study's `past` cell with every arm at the MoE model's early KL on the "
        "routes it acts with, each by its own lr from a paired calibration pilot, declared "
        "(experiments/conf/study/causal_matched.yaml) with its power, looks and new pool members.",
        report=declared_report.study_report("causal_matched"),
        claims={
            7: declared_claims.study_claim(
                7,
                "causal_matched",
                "dense_total_mup_minus_moe",
                declared_claims.study_claim(
                    7,
                    "causal",
                    "dense_total_mup_minus_moe",
                    declared_claims.stated_claim(
                        7,
                        "causal",
                        (
                            "first look, the dense control at a fixed lr (`dense_control`)",
                            _paired(mechanism_claims.MOE_SPECIFIC),
                        ),
                    ),
                ),
            ),
            14: declared_claims.study_claim(
                14,
                "causal_matched",
                "anchored_minus_moe",
                declared_claims.study_claim(14, "causal", "anchored_minus_moe"),
            ),
            15: declared_claims.study_claim(
                15,
                "causal_matched",
                "load_aware_minus_moe",
                declared_claims.study_claim(15, "causal", "load_aware_minus_moe"),
            ),
        },
    ),
    ResultsFolder(
        "length",
        ("length",),
        "Does response length change whether GRPO needs routing replay, and whether GSPO makes it unnecessary? "
        "GRPO with and without R2 and GSPO (and their kin) on reasoning-gym's basic_arithmetic at L = 4, 16, 32 "
        "digits, each length at the lr that gives grpo+none the same early per-update KL, from a pool of 6 cold "
        "starts per length.",
        report=declared_report.study_report("length"),
        claims_section=declared_claims.claims_section(
            "length",
            "Claims 2 and 3 by response length: the length study (earlier looks, L = 16 and 32 on a floor)",
            ("2", "3"),
        ),
        history="L = 16 and 32 on a floor and KL matched over dead steps; claims 12 and 13 re-read by length_edge",
    ),
    ResultsFolder(
        "length_edge",
        ("length_edge",),
        "Claims 12 and 13, and claims 2 and 3 along length, at each length's own edge (L = 4 and 16, each at the lr "
        "where grpo+none loses about 10 pp, placed by a pilot across starts), declared "
        "(experiments/conf/study/length_edge.yaml) with its power, looks, admission by reward signal and new pool "
        "members.",
        report=declared_report.study_report("length_edge"),
        claims={
            12: declared_claims.study_claim(
                12,
                "length_edge",
                "gspo_advantage_growth",
                declared_claims.study_claim(12, "length", "gspo_advantage_growth"),
            ),
            13: declared_claims.study_claim(
                13,
                "length_edge",
                "routing_share_growth",
                declared_claims.study_claim(13, "length", "routing_share_growth"),
            ),
        },
        claims_section=declared_claims.claims_section(
            "length_edge", "Claims 2 and 3 by response length, at each length's own edge", ("2", "3")
        ),
    ),
    ResultsFolder(
        "ladder",
        (),  # its runs are the phase preset's, with a geometry and lr each (the preset fills `phase`)
        "Where does routing carry the divergence? A pilot of the routing-dominance ladder: GRPO without replay at N = 8 "
        "over three lrs on 4 new pool members per model geometry (the default, 64 experts of width 64 at top-2 over 4 "
        "and 8 layers, the fine-grained 64 x 16 at top-8): each rung's edge, routing's share of the ratio variance "
        "and the routes an update changes.",
        report=with_provenance(ladder.write_ladder_report),
    ),
    ResultsFolder(
        "routing_dominant",
        ("routing_dominant",),
        "Claims 2 and 3 on the ladder's most routing-dominant affordable rung (64 experts of width 64, top-2, 4 "
        "layers: routing carries about 45% of the ratio variance), off-policy at N = 8 with every arm matched per "
        "start to GRPO without replay's early acting KL and a placebo arm, declared "
        "(experiments/conf/study/routing_dominant.yaml) on new pool members.",
        report=declared_report.study_report("routing_dominant"),
        claims_section=premise.with_premise(
            declared_claims.claims_section(
                "routing_dominant",
                "Claims 2 and 3 where routing carries about half of the ratio variance (64 experts, top-2, 4 layers)",
                ("2", "3"),
            )
        ),
    ),
    ResultsFolder(
        "calibration",
        (),
        "Which lr reaches a target early per-update KL, per arm and model (experiments/calibrate_kl.py's cache of "
        "its pilots and fits, kl.json; no runs kept)?",
    ),
    ResultsFolder(
        "gpu_check",
        (),
        "Do the GPU tests and the MegaBlocks backend pass on a GPU (scripts/gpu_check.sh; no runs)?",
    ),
)
# the folders the scale paragraph of CLAIMS.md reads, in its order, and those of collapse_definitions.md
SCALE_FOLDERS = (
    "phase",
    "phase_mismatch",
    "drift_scaling",
    "drift_forecast",
    "engine_mismatch",
    "engine_mismatch_stable",
    "dense_control",
    *phase.FAMILY_PHASES,
    "stabilizers",  # the leaderboard at the end of the page
)
COLLAPSE_FOLDERS = ("stress", "compare")
CLAIMS: dict[int, ClaimItem] = dict(sorted((i, c) for s in STUDIES for i, c in s.claims.items()))


def study_of_runs(runs_dir: Path) -> ResultsFolder | None:
    """The study whose presets made the runs under `runs_dir` (the experiment their meta.json records); first, the
    row of the runs' own folder where it names no preset but a report of its own (a pilot run with another
    preset's overrides, e.g. the ladder); None when no row names them all."""
    experiments = set(run_records(runs_dir)["experiment"].dropna())
    found = [s for s in STUDIES if experiments and experiments <= set(s.presets)]
    folder = runs_dir.parent.name if runs_dir.name == "runs" else runs_dir.name
    own = [s for s in STUDIES if s.folder == folder and not s.presets and s.report is not None]  # its own report
    chosen = own or found
    return chosen[0] if chosen else None


def claims(root: Path, presets: Path) -> list[Claim]:
    """Every study's claims, judged on the result folders under `root`, in id order."""
    return evaluate_claims(root, CLAIMS, presets)


def write_claims(root: Path, presets: Path, out: Path | None = None) -> Path:
    """RESULTS_ROOT/CLAIMS.md: the verdicts, the sections the studies add (in page order), the provenance."""
    sections = [line for s in STUDIES if s.claims_section for line in s.claims_section(root, presets)]
    return write_claims_page(root, claims(root, presets), sections, SCALE_FOLDERS, out)
