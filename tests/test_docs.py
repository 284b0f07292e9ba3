"""The README is a front door and docs/ holds the rest: links resolve, lists match the files they list.

Checks: every relative link of README.md and docs/*.md reaches a file of this repository; the README
stays at most `README_MAX_LINES` lines; its claims table gives the verdicts of results/CLAIMS.md; the
config groups listed in docs/experiments.md and the arms of docs/papers.md are the files of
experiments/conf/; no page promises bitwise reruns across CPU vendors; LOG.md is a dated record, every entry
headed `## YYYY-MM-DD name` and the dates in order.
"""

from __future__ import annotations

import re
from datetime import date
from pathlib import Path

import pytest
from helpers import ROOT

from moe_rl.routing.modes import REPLAY_MODES

README_MAX_LINES = 200
CONF = ROOT / "experiments" / "conf"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
LOG_ENTRY = re.compile(r"^## (\d{4}-\d{2}-\d{2}) .+")
VERDICT = re.compile(r"\*\*(reproduced|not reproduced|inconclusive|untestable here|unmatched)\*\*")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """`text` without fenced code blocks and inline code, where brackets are code, not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Relative links of `page` whose file is missing or lies outside `root` (anchors are not checked)."""
    out = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor of the page itself
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(root.resolve()) or not path.exists():
            out.append(target)
    return out


def _cells(row: str) -> list[str]:
    """The cells of a markdown table row (`\\|` inside a cell is not a separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def _section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def stems(group: str) -> set[str]:
    return {p.stem for p in (CONF / group).glob("*.yaml")}


def verdicts(text: str) -> dict[int, str]:
    """Claim number -> verdict of every table row `| N | ... | **verdict** | ... |` in `text`."""
    out = {}
    for row in text.splitlines():
        number = re.match(r"\|\s*(\d+)\s*\|", row)
        found = VERDICT.findall(row)
        if number and found:
            assert len(set(found)) == 1, f"a claim row with two verdicts: {row[:120]}"
            out[int(number.group(1))] = found[0]
    return out


def log_dates(text: str) -> list[date]:
    """The date of every `## ` entry of LOG.md, in file order; a heading of another form is an error."""
    out = []
    for line in text.splitlines():
        if line.startswith("## "):
            entry = LOG_ENTRY.match(line)
            if entry is None:
                raise ValueError(f"LOG.md: an entry heading without its date first: {line!r}")
            out.append(date.fromisoformat(entry.group(1)))
    return out


def group_lists(text: str) -> dict[str, list[str]]:
    """Group -> the choices docs/experiments.md lists for it, from the table of its "Config groups"."""
    rows = [_cells(r) for r in _section(text, "## Config groups").splitlines() if r.startswith("| `")]
    return {_names(cells[0])[0]: _names(cells[1]) for cells in rows}


def paper_arms(text: str) -> list[str]:
    """Every arm named in the `arm` column of docs/papers.md's table."""
    rows = [_cells(r) for r in text.splitlines() if r.startswith("|")]
    column = rows[0].index("arm")
    return [name for cells in rows[2:] for name in _names(cells[column])]


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_files_of_the_repository(page: Path) -> None:
    assert broken_links(page) == []


def test_broken_links_are_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[ok](../there.md) [ok](../there.md#a) [web](https://x.org/a.md) [self](#top) `[code](gone.md)`\n"
        "[gone](gone.md) [outside](../../elsewhere.md)\n```\n[block](gone2.md)\n```\n"
    )
    assert broken_links(page, tmp_path) == ["gone.md", "../../elsewhere.md"]


def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md: move the details to a page of docs/"
    for command in ("bash scripts/compare.sh", "bash scripts/test.sh"):
        assert f"```bash\n{command}\n```" in text
    mapped = set(re.findall(r"\]\((docs/[^)#]+\.md)\)", text))
    assert {p.relative_to(ROOT).as_posix() for p in pages()[1:]} <= mapped, "a page of docs/ missing from the map"


PROSE_WIDTH = 120  # characters; tables and code blocks are exempt


def long_prose_lines(text: str) -> list[int]:
    """The line numbers (1-based) of prose lines wider than PROSE_WIDTH: outside code fences, not table rows."""
    found, fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        elif not fence and not line.startswith("|") and len(line) > PROSE_WIDTH:
            found.append(number)
    return found


def test_long_prose_lines_are_found() -> None:
    text = "\n".join(["x" * 121, "| " + "y" * 200, "```", "z" * 200, "```", "w" * 120])
    assert long_prose_lines(text) == [1]


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_prose_lines_keep_to_the_width(page: Path) -> None:
    """So a page's line cap cannot be dodged sideways."""
    assert long_prose_lines(page.read_text()) == [], f"{page.name}: rewrap to {PROSE_WIDTH} characters"


def test_the_declaration_key_table_is_generated() -> None:
    from moe_rl.studies.declaration_keys import key_table

    text = (ROOT / "docs" / "experiments.md").read_text()
    begin, end = (
        "<!-- declaration keys: python -m moe_rl.studies.declaration_keys -->",
        "<!-- end of declaration keys -->",
    )
    assert text.split(begin, 1)[1].split(end, 1)[0].strip() == key_table(), (
        "paste python -m moe_rl.studies.declaration_keys"
    )


def test_readme_verdicts_are_those_of_claims_md() -> None:
    shipped = verdicts(_section((ROOT / "results" / "CLAIMS.md").read_text(), "## Table"))
    assert len(shipped) >= 7
    assert verdicts((ROOT / "README.md").read_text()) == shipped


def test_verdicts_reads_a_claims_table() -> None:
    table = "| # | claim | verdict |\n|---|---|---|\n| 1 | a | **inconclusive** |\n| 2 | b | **not reproduced** |\n"
    assert verdicts(table) == {1: "inconclusive", 2: "not reproduced"}


def test_config_group_lists_are_the_files_of_experiments_conf() -> None:
    listed = group_lists((ROOT / "docs" / "experiments.md").read_text())
    groups = {p.name for p in CONF.iterdir() if p.is_dir() and any(p.glob("*.yaml"))}
    assert set(listed) == groups
    for group, names in listed.items():
        assert len(names) == len(set(names)), group
        assert set(names) == stems(group), f"docs/experiments.md lists other {group} choices than experiments/conf/"


def test_replay_modes_are_the_replay_group() -> None:
    assert set(REPLAY_MODES) == stems("replay")


def test_every_arm_has_its_paper_row() -> None:
    arms = paper_arms((ROOT / "docs" / "papers.md").read_text())
    assert set(arms) == stems("arm"), "docs/papers.md: one row per arm of experiments/conf/arm/"


def test_group_and_arm_parsers_read_their_tables() -> None:
    text = "## Config groups\n\n| group | choices | what |\n|---|---|---|\n| `replay` | `none`, `r2` | x |\n\n## Next\n"
    assert group_lists(text) == {"replay": ["none", "r2"]}
    papers = "| method | arm | code |\n|---|---|---|\n| A | `a_x`, `a_y` | `f\\|g` |\n| B | `b` | `h` |\n"
    assert paper_arms(papers) == ["a_x", "a_y", "b"]


def test_no_page_promises_bits_across_cpu_vendors() -> None:
    for page in pages():
        text = " ".join(page.read_text().split())
        assert "on any x86 CPU" not in text, page
        assert "bitwise reruns across CPUs" not in text, page


def test_log_is_a_dated_record_in_date_order() -> None:
    dates = log_dates((ROOT / "LOG.md").read_text())
    assert dates, "LOG.md has no entries"
    earlier = [f"{b} after {a}" for a, b in zip(dates, dates[1:]) if b < a]
    assert earlier == [], "LOG.md: an entry dated before the one above it (append new entries at the end)"


def test_log_dates_reads_entry_headings() -> None:
    text = "# Log\n\nwhat it is\n\n## 2026-11-30 phase (results/phase/)\n### a detail\n## 2026-12-01 a change\n"
    assert log_dates(text) == [date(2026, 11, 30), date(2026, 12, 1)]
    for heading in ("## Claims", "## 2026-11-30: a colon", "## compare (2026-12-02)", "## 2026-13-01 no month"):
        with pytest.raises(ValueError):
            log_dates(heading + "\n")


def test_the_readme_claim_table_is_generated_from_claims_csv() -> None:
    """README.md's claim table is `report --readme`'s from results/claims.csv, which `report --claims` writes with
    CLAIMS.md: the same claims and verdicts as CLAIMS.md's table."""
    from moe_rl.analysis.pages import README_CLAIMS, read_claims, readme_block, readme_claims_table

    table = read_claims(ROOT / "results")
    assert table is not None, "results/claims.csv is shipped"
    shipped = verdicts(_section((ROOT / "results" / "CLAIMS.md").read_text(), "## Table"))
    assert dict(zip(table["id"].astype(int), table["verdict"], strict=True)) == shipped
    assert readme_block(ROOT / "README.md", README_CLAIMS) == readme_claims_table(ROOT / "results"), (
        "README.md's claim table is stale: run `python -m moe_rl.report --readme results`"
    )


def test_findings_quote_the_shipped_runs_at_n_4() -> None:
    """docs/findings.md's per-loss accuracy changes at lr 3e-4, N = 4 are the means of the shipped runs there."""
    import numpy as np

    from moe_rl.studies import frontier as fr

    line = re.search(
        r"\(GRPO ([-\d.]+), DPPO-TV ([-\d.]+), VESPO ([-\d.]+), SAPO ([-\d.]+), CISPO ([-\d.]+), "
        r"plain IS ([-\d.]+) pp over (\d+) runs each\)",
        " ".join((ROOT / "docs" / "findings.md").read_text().split()),
    )
    assert line is not None, "the N = 4 sentence of docs/findings.md moved: update this test with it"
    runs = fr.load_runs([ROOT / "results"])
    at = runs[np.isclose(runs["lr"].astype(float), 3e-4) & np.isclose(runs["N"].astype(float), 4)]
    at = at[at["family"] == "qwen3_moe"].groupby("arm_file")["change"]
    arms = ("grpo_none", "dppo_tv_none", "vespo_none", "sapo_none", "cispo_none", "is_none")
    assert [f"{100 * at.mean()[a]:.1f}" for a in arms] == list(line.groups()[:6])
    assert {int(at.count()[a]) for a in arms} == {int(line.group(7))}
