"""The keys a study's declaration may use, and the read of its YAML that names the file and line of what is wrong.

`KEYS` is the one list of a declaration's keys (a dotted path, `*` for a name of the study's own choosing, `[]` for
an entry of a list), each with its meaning, its default and an example; `read_declaration` refuses a YAML error or a
key outside it in one line, `path:line: ...`, with the nearest known key where one is close; `key_table` is the
markdown table docs/experiments.md shows (`python -m moe_rl.studies.declaration_keys`)."""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True)
class Key:
    path: str  # dotted; `*` a name the study chooses, `[]` an entry of a list
    meaning: str
    default: str = "required"
    example: str = ""


KEYS: tuple[Key, ...] = (
    Key("name", "the study's name: its results folder and launcher argument", "the file's stem", "routing_dominant"),
    Key("question", "the question it answers, one paragraph", example="does R2 end GRPO higher than no replay?"),
    Key("order", "its place in the registry: the index's rows and CLAIMS.md's sections, ascending", example="320"),
    Key("status", "current, or history: kept beside the study that supersedes it, or a pilot", "current", "history"),
    Key("reason", "history: why, and by what", "required where history"),
    Key("superseded_by", "history: the study that re-reads what it read", "none", "offpolicy_edge"),
    Key("presets", "the presets whose runs its folder holds (their `experiment` key)", "a study: [name]; else []"),
    Key(
        "report",
        "its report, module:function (runs, out, presets) -> files",
        "a study's declared report; a folder's report by arm",
        "moe_rl.studies.ladder:report",
    ),
    Key(
        "decides.*.contrast",
        "a claim whose reading it holds: the contrast that reads it",
        "or a reader",
        "r2_minus_none",
    ),
    Key("decides.*.reader", "or a reading of its own, module:function (root, presets) -> Claim", "or a contrast"),
    Key("decides.*.earlier", "the folder whose reading of the claim this one follows (its earlier look)", "none"),
    Key("claims_section", "its section of CLAIMS.md: module:function (root, presets) -> lines", "none"),
    Key("claims_section.title", "or its contrasts of other claims' readings in a table: the section's title"),
    Key("claims_section.claims", "the claims whose contrasts the table shows", example='["2", "3"]'),
    Key("claims_section.then", "a section that follows that table, module:function", "none"),
    Key(
        "claims_section.rung",
        "the rung those claims were read on: their readings fill the claim table's rung column",
        "none",
        '"64 experts, top-2, 4 layers"',
    ),
    Key("preset", "the Hydra preset every run composes (experiments/conf/preset/NAME.yaml)", example="phase"),
    Key("overrides", "Hydra overrides every run gets", "[]", "[model.num_experts=64]"),
    Key("arms.*.overrides", "an arm: its Hydra overrides", example="[arm=grpo_r2]"),
    Key("arms.*.ref", "the reference model whose level lr the arm runs at", "none", "moe"),
    Key("arms.*.lr_scale", "the arm's multiplier of that lr", "1.0", "1.3"),
    Key("levels.*.overrides", "a level: its Hydra overrides", "[]", "[optim.updates_per_rollout=8]"),
    Key("levels.*.lr", "the level's lr per reference model", "the preset's lr", "{moe: 3.0e-4}"),
    Key("unit.members", "the pool members it draws (cold-start seeds), new for each study", example="2100..2123"),
    Key("unit.seeds_per_start", "run seeds per member", "1", "2"),
    Key("unit.reuse", "other studies whose members it shares, each with why", "{}", "{causal: same pool as ran}"),
    Key("unit.admit.min_sampled_reward", "admit only warm-ups whose samples reach this mean reward", "0.0", "0.05"),
    Key("unit.admit.max_zero_variance", "admit only warm-ups with at most this share of constant groups", "1.0", "0.9"),
    Key("unit.admit.in_band", "admit only warm-ups that ended inside their accuracy band", "false", "true"),
    Key("unit.pool", "as ran: the pool its preset's cold start draws from", "none", "6"),
    Key("unit.start", "the unit: `cold start` (each warm-up) or `member` (twins on two machines)", "cold start"),
    Key("outcome", "what a run contributes (`design.OUTCOMES`)", "change", "routing_share"),
    Key("contrasts[].name", "a contrast's name (a study has one or more; a pilot none)", example="r2_minus_none"),
    Key("contrasts[].cells", "its linear combination of cells arm@level", example="{grpo_r2@hi: 1, grpo_none@hi: -1}"),
    Key("contrasts[].direction", "the claimed sign: greater or less", "greater", "less"),
    Key("contrasts[].claim", "the claim it decides, or exploratory", "exploratory", '"2"'),
    Key("contrasts[].requires", "the reference's combination that must degrade for it to be testable", "{}"),
    Key("contrasts[].requires_below", "testable where `requires` has a mean below this", "0.0", "-0.05"),
    Key("contrasts[].outcome", "an outcome of its own", "the study's"),
    Key("contrasts[].mde", "its MDE in its outcome's units", "the design's"),
    Key("contrasts[].margin", "its margin in its outcome's units", "the design's"),
    Key("pilot.reference", "a pilot (no contrasts): the arm whose loss it reads per level", "not a pilot", "grpo_none"),
    Key("pilot.loss", "the loss (accuracy lost, a fraction) its edge lies in", "[0.1, 0.2]"),
    Key("pilot.floor", "the largest share of the edge's runs at accuracy 0", "0.5"),
    Key("design.mde", "the smallest difference it is sized to detect", "required (a pilot: 0.05)", "0.05"),
    Key("design.power", "its power at the MDE", "0.8"),
    Key("design.alpha", "its one-sided level", "0.025"),
    Key("design.looks", "the starts after which it decides", example="[8, 16, 24]"),
    Key("design.margin", "the difference a not-reproduced verdict excludes", "the MDE"),
    Key("design.margin_relative", "the margin as a share of the reference's own loss", "none", "0.5"),
    Key("design.futility", "stop where the futility boundary is crossed", "true"),
    Key("design.sized_from", "where its start count came from: the pilot and its variance", "required (not a pilot)"),
    Key("match.divergence", "the per-run divergence arms are matched on", "kl_acting"),
    Key("match.tolerance", "the ratio band [1/t, t] a matched contrast must realise", "1.05"),
    Key("match.placebo", "the contrast of the reference against itself at another lr", "none", "placebo_minus_none"),
    Key("match.contrasts", "the contrasts the match holds for", "all but the placebo"),
    Key("match.reference", "match per start by probes to this arm", "none", "grpo_none"),
    Key("match.probe_steps", "a probe's steps", "20"),
    Key("match.bracket", "the lr multipliers each arm probes at", "[0.8, 1.0, 1.25]"),
    Key(
        "match.confirm", "multipliers of each seed's solved lr it also probes at; the run takes its nearest probe", "[]"
    ),
    Key("match.per", "start: an lr per seed; pool: one lr per arm, from the first look's probes", "start", "pool"),
    Key("runs[].arms", "as ran: a block's arms", example="[grpo_none]"),
    Key("runs[].levels", "as ran: a block's levels", example="[hi]"),
    Key("runs[].replicates", "as ran: the replicates a block ran of each member", "0 .. seeds_per_start - 1"),
    Key("not_run[].levels", "as ran: the levels whose cells skipped seeds"),
    Key("not_run[].arms", "as ran: their arms", "every arm"),
    Key("not_run[].seeds", "as ran: the run seeds skipped"),
    Key("duplicates[].cells", "cells that compose to one run config, run anyway", example="[a@s1, b@s1]"),
    Key("duplicates[].reason", "why they all run"),
    Key("columns.*", "a run mean its cell table adds: name: metric key", "{}", "{clip: clip/frac}"),
    Key("claims.*.text", "as ran: the statement of a claim it first decided"),
    Key("claims.*.source", "as ran: where the claim comes from"),
    Key("declared", "as ran: where and when its design was written", '"" (declared before its runs)'),
    Key(
        "as_ran.member",
        "as ran by presets (runs named by their overrides, no `arm@level` folders): the override naming a run's "
        "pool member",
        "member 0 (one cold start per model)",
        "cold_start.seed",
    ),
    Key("axes.*", "an axis (its levels in order) its report draws each arm's profile along", "{}", "{S: [s1, s2]}"),
    Key("readme", "a table of it in README.md: true, or the contrasts to show", "none", "true"),
    Key("sections", 'computations of its own its report calls, "module:function"', "[]"),
    Key("frontier.*", "the frontier's bisection (rows, axes, seeds; `moe_rl.studies.frontier`)", "none"),
    Key("compiled", "every run compiled (inductor's kernels) instead of eager", "false", "true"),
)
# mappings whose keys are the study's own (metric names, cells, studies, reference models), as patterns
FREE = ("columns", "axes", "frontier", "unit.reuse", "levels.*.lr", "contrasts.[].cells", "contrasts.[].requires")


_KNOWN = {k.path.replace("[]", ".[]") for k in KEYS}  # as `_walk` spells a path: a list entry a part of its own
_PREFIXES = {p.rsplit(".", i)[0] for p in _KNOWN for i in range(1, p.count(".") + 1)}


def _generic(parts: tuple[str, ...]) -> list[str]:
    """The patterns a concrete key path may match (each name part either itself or `*`)."""
    out = [""]
    for part in parts:
        out = [f"{o}.{c}" if o else c for o in out for c in dict.fromkeys((part, "*"))]
    return out


def _walk(node: yaml.Node, parts: tuple[str, ...], out: list[tuple[tuple[str, ...], int]]) -> None:
    """Every key path of the composed YAML with its line (1-based); a list's entries as `[]`."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = (*parts, str(key.value))
            out.append((path, key.start_mark.line + 1))
            _walk(value, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _walk(item, (*parts, "[]"), out)


def _check(path: Path, root: yaml.Node) -> None:
    found: list[tuple[tuple[str, ...], int]] = []
    _walk(root, (), found)
    for parts, line in found:
        candidates = _generic(parts)
        if any(c in _KNOWN or c in _PREFIXES or c.startswith(tuple(f + "." for f in FREE)) for c in candidates):
            continue
        parents = _generic(parts[:-1]) if len(parts) > 1 else [""]
        siblings = sorted(
            {
                k[len(p) + 1 :].split(".")[0] if p else k.split(".")[0]
                for k in _KNOWN
                for p in parents
                if not p or k.startswith(p + ".")
            }
            - {"*", "[]"}
        )
        near = difflib.get_close_matches(parts[-1], siblings, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else f"; known here: {', '.join(siblings)}"
        where = ".".join(parts).replace(".[]", "[]")
        raise ValueError(f"{path}:{line}: unknown key {where!r}{hint}")


def read_declaration(path: str | Path) -> dict:
    """The declaration's YAML as a mapping; a YAML error, a document that is not a mapping or a key outside `KEYS`
    is refused in one line naming the file and line."""
    path = Path(path)
    text = path.read_text()
    loader = yaml.SafeLoader(text)
    try:  # parsed once: the node tree (its lines) and the data constructed from it
        root = loader.get_single_node()
        raw = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{path}{line}: not valid YAML: {problem}") from None
    finally:
        loader.dispose()
    if not isinstance(raw, dict) or root is None:
        raise ValueError(f"{path}:1: a declaration is a mapping of keys (name, question, preset, arms, ...)")
    _check(path, root)
    return raw


def key_table() -> str:
    """The markdown table of `KEYS` (key, meaning, default, example)."""
    lines = ["| key | meaning | default | example |", "|---|---|---|---|"]
    for k in KEYS:
        example = f"`{k.example}`" if k.example else ""
        lines.append(f"| `{k.path}` | {k.meaning} | {k.default} | {example} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(key_table() + "\n")
