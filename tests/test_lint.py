"""Repository checks: ruff (the rules of pyproject [tool.ruff.lint]), import direction, design references."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import ROOT


def test_ruff_finds_no_undefined_names_or_unused_imports() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is missing: it is in the test extra (pip install -e '.[test]')"
    out = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (absolute names), at top level, inside functions or under `if TYPE_CHECKING:`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_routing_never_imports_models() -> None:
    """`moe_rl.models` uses `moe_rl.routing` (router checks at load); the reverse would make a cycle."""
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in _imported_modules(path) if m.startswith("moe_rl.models"))
        for path in sorted((ROOT / "moe_rl" / "routing").glob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    # the check itself sees imports: models does import routing
    assert any(m.startswith("moe_rl.routing") for m in _imported_modules(ROOT / "moe_rl" / "models" / "__init__.py"))


def test_design_references_point_at_existing_sections() -> None:
    """Docstrings cite the design as "docs/design.md §n"; each n must be a section of that file."""
    sections = {int(m) for m in re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "design.md").read_text(), re.M)}
    assert sections == set(range(1, 8))
    cited: dict[str, set[int]] = {}
    for path in [*ROOT.glob("moe_rl/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("notebooks/*.ipynb")]:
        for ref in re.findall(r"design\.md ((?:§\d+(?:, |-)?)+)", path.read_text()):
            cited.setdefault(str(path.relative_to(ROOT)), set()).update(int(n) for n in re.findall(r"§(\d+)", ref))
        assert "DESIGN" + " §" not in path.read_text(), f"{path}: cite docs/design.md §n"  # split: not a hit itself
    assert len(cited) > 20
    assert {path: sorted(ns - sections) for path, ns in cited.items() if ns - sections} == {}


# Which package may import which (docs/design.md §5): lower layers never import higher ones, and every module
# sits in its package's layer. The top level (the loop `train`, its `config`, the `python -m` commands) may import
# anything. An import under `if TYPE_CHECKING:` counts too: an annotation that names a higher layer is an arrow up.
LAYERS: dict[str, set[str]] = {
    "metrics": set(),
    "tasks": set(),
    "run": {"metrics", "tasks"},
    "routing": {"metrics"},
    "models": {"routing", "tasks"},
    "algos": {"metrics"},
    "rollout": {"metrics", "models", "routing", "run", "tasks"},
    "loop": {"algos", "config", "metrics", "models", "rollout", "routing", "run", "tasks"},
    "integrations": {"algos", "metrics", "models", "rollout", "routing", "tasks"},
    "analysis": {"metrics", "run"},
    "studies": {"analysis", "metrics", "run"},
}


def test_packages_import_only_the_layers_below_them() -> None:
    packages = {p.name for p in (ROOT / "moe_rl").iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYERS), "a package without a layer: add it to LAYERS and to docs/design.md §5"
    top_level = sorted(p.stem for p in (ROOT / "moe_rl").glob("*.py") if p.stem != "__init__")
    assert len(top_level) <= 8, f"at most eight top-level modules besides __init__: {top_level}"
    bad: dict[str, list[str]] = {}
    for package, allowed in LAYERS.items():
        for path in sorted((ROOT / "moe_rl" / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            used = {m.split(".")[1] for m in _imported_modules(path) if m.startswith("moe_rl.")}
            if wrong := sorted(used - allowed - {package}):
                bad[module] = wrong
    assert bad == {}


def test_layers_are_an_order() -> None:
    """No two packages may import each other, directly or through others: the layers sort, lowest first."""
    left = {package: allowed & set(LAYERS) for package, allowed in LAYERS.items()}
    while ready := {package for package, below in left.items() if not below}:
        left = {package: below - ready for package, below in left.items() if package not in ready}
    assert left == {}, f"a cycle among {sorted(left)}"


def test_no_module_is_longer_than_600_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "moe_rl").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}
