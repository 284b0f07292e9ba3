"""Metric names are defined once: the registry, the generated tables, and the keys runs really log.

(The keys a fresh run logs, per arm, are checked by `tests/test_train.py::test_short_run_per_arm`.)
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from helpers import ROOT

from moe_rl.metrics import names
from moe_rl.metrics import table as metric_names
from moe_rl.metrics.names import METRICS, defines
from moe_rl.metrics.table import render_table, with_table


def test_generated_table_matches_the_registry() -> None:
    assert metric_names.PAGE == ROOT / "docs" / "metrics.md"
    text = metric_names.PAGE.read_text()
    assert with_table(text, "docs/metrics.md") == text, "run python -m moe_rl.metrics.table --write"
    assert render_table() in text
    assert metric_names.main([]) == 0  # the default file is the page


def test_the_table_is_generated_into_one_page_only() -> None:
    """Other pages link to docs/metrics.md; a second copy of the table would be a second thing to keep fresh."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    holders = [p.relative_to(ROOT).as_posix() for p in pages if metric_names.BEGIN in p.read_text()]
    assert holders == ["docs/metrics.md"]


def test_check_mode_fails_on_a_stale_table_and_write_mode_fixes_it(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    stale = f"intro\n{metric_names.BEGIN}\n| `reward/mean` | an old definition |\n{metric_names.END}\noutro\n"
    doc.write_text(stale)
    assert metric_names.main([str(doc)]) == 1
    assert doc.read_text() == stale  # checking never writes
    assert metric_names.main(["--write", str(doc)]) == 0
    assert doc.read_text() == f"intro\n{metric_names.BEGIN}\n{render_table()}\n{metric_names.END}\noutro\n"
    assert metric_names.main([str(doc)]) == 0
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="no metric table markers"):
        metric_names.main([str(doc)])


def test_every_key_is_defined_once_and_constants_are_defined() -> None:
    keys = [m.key for m in METRICS]
    assert len(keys) == len(set(keys))
    constants = {
        name: value
        for name, value in vars(names).items()
        if name.isupper()
        and isinstance(value, str)
        and value != names.OFFPOLICY_SUFFIX
        and "/" in value
        and not value.endswith("/")
        and not value.startswith("<!--")
    }
    assert len(constants) > 30
    assert {name: key for name, key in constants.items() if not defines(key)} == {}


@pytest.mark.parametrize(
    "key, defined",
    [
        ("route/old_vs_new/flip_rate", True),
        ("route/rollout_vs_old/expert_flip_frac/layer_3", True),
        ("route/old_vs_new/flip_rate/offpolicy", True),
        ("route/old_vs_new/shift/mean/offpolicy", True),
        ("route/old_vs_new/shift/layer_1", True),
        ("route/old_vs_new/flip_rate/pos_8", True),
        ("route/flip_vs_margin/flips/bin_7", True),
        ("kl/k3/offpolicy", True),
        ("route/some_pair/flip_rate", False),  # an unknown pair
        ("route/old_vs_new/token_flip_rate/layer_0", False),  # token flip rates have no per-layer value
        ("ratio/token_max/offpolicy", False),  # not an off-policy key
        ("reward/meen", False),
        ("route/old_vs_new/flip_rate/pos_x", False),
    ],
)
def test_defines_expands_patterns_and_suffixes(key: str, defined: bool) -> None:
    assert defines(key) is defined


def test_shipped_runs_log_only_defined_keys() -> None:
    files = sorted(ROOT.glob("results/*/runs/*seed=0*/metrics.parquet"))
    assert len(files) >= 7
    keys: set[str] = set()
    for path in files:
        keys.update(pc.unique(pq.read_table(path, columns=["key"])["key"]).to_pylist())
    assert len(keys) > 80
    assert sorted(k for k in keys if not defines(k)) == []
