"""The study registry: one row per shipped results folder, every claim decided once, the generated results index."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pandas as pd
import pytest
from helpers import PRESETS, ROOT

from moe_rl import studies
from moe_rl.studies import ResultsFolder
from moe_rl.studies.design import load_study, study_files
from moe_rl.studies.index import independent_line, index_markdown, seed_ranges, verdicts, wall

ROWS = studies.registry(PRESETS)


def test_every_results_folder_has_one_declaration_and_every_row_its_presets() -> None:
    folders = [s.folder for s in ROWS]
    assert len(folders) == len(set(folders))
    assert folders[0] == "compare"  # the main job first
    assert [s.order for s in ROWS] == sorted(s.order for s in ROWS)
    declared = {p.stem for p in study_files(PRESETS.parent / "study")}  # a declared study names its runs
    shipped_folders = {p.name for p in (ROOT / "results").iterdir() if p.is_dir()}
    assert shipped_folders <= set(folders) and set(folders) - shipped_folders <= declared  # declared: runs may come
    shipped = {p.stem for p in PRESETS.glob("*.yaml")} | declared
    assert {p for s in ROWS for p in s.presets} <= shipped
    named = [p for s in ROWS for p in s.presets]
    assert len(named) == len(set(named)), "a preset fills one folder"
    assert {s.superseded_by for s in ROWS if s.superseded_by} <= set(folders)
    assert all(s.history for s in ROWS if s.superseded_by)


def test_every_claim_is_decided_by_one_study_in_id_order() -> None:
    ids = [i for s in ROWS for i in s.claims]
    declared = list(range(1, 16))
    assert sorted(ids) == declared and len(ids) == len(set(ids))
    assert list(studies.claim_items(PRESETS)) == declared
    assert {s.folder: sorted(s.claims) for s in ROWS if s.claims} == {
        "phase": [6],
        "offpolicy_edge": [2, 3],
        "engine_gap": [5],
        "depth_drift": [4],
        "drift_forecast": [1],
        "router_defaults": [8],
        "staleness_erosion": [10, 11],
        "causal_matched": [14],
        "default_mechanism": [9, 15],
        "dense_pooled": [7],
        "length_edge": [12, 13],
    }


def _declare(folder: Path, name: str, **keys: object) -> None:
    import yaml

    (folder / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, "question": "?", **keys}))


def test_the_registry_follows_each_claim_to_its_current_reading_and_refuses_two(tmp_path: Path) -> None:
    """a's reader is followed by b's, b's by c's: c holds the claim; a second reading nobody follows is refused in
    one line naming the fix, as is a missing order and an `earlier` that does not read the claim."""
    presets = tmp_path / "preset"
    folder = tmp_path / "study"
    folder.mkdir()
    reader = "moe_rl.studies.shift_claim:claim"
    _declare(folder, "a", order=1, decides={"6": {"reader": reader}})
    _declare(
        folder, "b", order=3, status="history", reason="re-read by c", decides={"6": {"reader": reader, "earlier": "a"}}
    )
    _declare(folder, "c", order=2, decides={"6": {"reader": reader, "earlier": "b"}})
    rows = studies.registry(presets)
    assert [r.folder for r in rows] == ["a", "c", "b"] and [sorted(r.claims) for r in rows] == [[], [6], []]
    assert rows[2].history == "re-read by c" and rows[0].report is None
    _declare(folder, "d", order=4, decides={"6": {"reader": reader}})
    studies._registry.cache_clear()
    with pytest.raises(ValueError, match="claim 6 is also read by"):
        studies.registry(presets)
    _declare(folder, "d", order=4, decides={"6": {"contrast": "x", "earlier": "nosuch"}})
    studies._registry.cache_clear()
    with pytest.raises(ValueError, match="names 'nosuch', which does not read claim 6"):
        studies.registry(presets)
    _declare(folder, "d")
    studies._registry.cache_clear()
    with pytest.raises(ValueError, match="d.yaml: a declaration needs `order`"):
        studies.registry(presets)
    _declare(folder, "d", order=4, report="moe_rl.studies.nosuch:report")
    studies._registry.cache_clear()
    with pytest.raises(ValueError, match="names no module:function"):
        studies.registry(presets)
    _declare(folder, "d", order=1)
    studies._registry.cache_clear()
    with pytest.raises(ValueError, match="share an order: \\[1, 1\\]"):
        studies.registry(presets)
    studies._registry.cache_clear()


def test_a_folder_declaration_is_not_a_study_to_launch() -> None:
    with pytest.raises(ValueError, match="declares a results folder, not a study \\(no arms\\): its runs came from"):
        load_study(PRESETS.parent / "study" / "phase_mixtral.yaml")


def test_the_study_of_runs_is_read_from_their_meta_json(tmp_path: Path) -> None:
    def run(name: str, experiment: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(json.dumps({"run_keys": {"experiment": experiment, "seed": 0}}))

    run("a", "mechanism_gentle")
    assert studies.study_of_runs(tmp_path, PRESETS).folder == "mechanism_gentle"
    run("b", "phase_edge")  # runs of two studies: no study's report, the folder report
    assert studies.study_of_runs(tmp_path, PRESETS) is None
    assert studies.study_of_runs(tmp_path / "nothing", PRESETS) is None


def test_nothing_in_the_package_reads_the_checkout() -> None:
    """The presets and configs are passed in (`--presets`, `--conf`): no module resolves a path into experiments/."""
    found = {
        str(p.relative_to(ROOT)): line.strip()
        for p in sorted((ROOT / "moe_rl").rglob("*.py"))
        for line in p.read_text().splitlines()
        if re.search(r"parents\[\d\].*experiments|/ \"experiments\"", line)
    }
    assert found == {}


def test_results_index_is_current() -> None:
    page = ROOT / "results" / "README.md"
    assert page.read_text() == index_markdown(ROOT / "results", PRESETS), (
        "results/README.md is stale: run `python -m moe_rl.report --index results`"
    )
    text = page.read_text()
    assert text.index("[compare](compare/summary.md)") < text.index("[phase](phase/summary.md)")
    assert "| 6: inconclusive |" in text  # the phase map decides claim 6 (2 and 3: the offpolicy_edge study)


def test_index_helpers() -> None:
    assert seed_ranges([5, 0, 1, 2, 6]) == "0-2, 5-6" and seed_ranges([]) == "—"
    assert wall(0) == "—" and wall(125) == "2 min" and wall(3 * 3600 + 300) == "3 h 05 min"
    found = verdicts(ROOT / "results")
    assert sorted(found) == list(range(1, 16)) and set(found.values()) <= {
        "not reproduced",
        "inconclusive",
        "reproduced",
        "untestable here",
        "unmatched",
    }


def test_the_frontier_launcher_reads_run_status_with_the_status_module(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("frontier_launcher", ROOT / "experiments" / "frontier.py")
    assert spec is not None and spec.loader is not None
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    assert not launcher._finished(tmp_path)  # no status.json yet
    for status, finished in (("running", False), ("completed", True), ("collapsed", True), ("failed", True)):
        (tmp_path / "status.json").write_text(json.dumps({"status": status, "reason": "not running any more"}))
        assert launcher._finished(tmp_path) is finished, status


def test_the_index_counts_a_start_once_and_a_pilots_own_starts_apart() -> None:
    """Folders a and b share start s1; b's pilot warmed s9 (its own) and s2 (also a folder's): 3 starts behind the
    folders plus 1 a pilot alone warmed; the history folder b does not count toward the current ones."""
    rows = [ResultsFolder("a", (), "?"), ResultsFolder("b", (), "?", history="superseded")]
    records = {"a": pd.DataFrame({"cold_start": ["s1", "s2"]}), "b": pd.DataFrame({"cold_start": ["s1", "s3", None]})}
    line = independent_line(rows, records, {"b": pd.DataFrame({"cold_start": ["s9", "s2"]})})
    assert "all 2 folders: 4, of which 1 warmed for calibration pilots alone (b/pilot;" in line
    assert "; 2 behind the folders that are not history (b are)" in line
