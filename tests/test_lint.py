"""Repository checks: ruff (the rules of pyproject [tool.ruff.lint]), import direction and cycles, design references."""

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
    """Every module `path` imports (absolute names), at top level, inside functions or under `if TYPE_CHECKING:`;
    `from a import b` names both `a` and `a.b` (b may be a module: `from moe_rl import config`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
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


# Which package or top-level module may import which (docs/design.md §5): lower layers never import higher ones, and
# every module sits in its package's layer (a top-level module is its own). An import under `if TYPE_CHECKING:` counts
# too: an annotation that names a higher layer is an arrow up.
_LOOP = {"algos", "config", "loop", "metrics", "models", "rollout", "routing", "run", "tasks"}  # train's layers
_STUDIES = {"analysis", "metrics", "run", "studies"}  # the torch-free pages' layers
LAYERS: dict[str, set[str]] = {
    "metrics": set(),
    "tasks": set(),
    "run": {"metrics", "tasks"},
    "routing": {"metrics"},
    "models": {"routing", "tasks"},
    "algos": {"metrics"},
    "rollout": {"metrics", "models", "routing", "run", "tasks"},
    # top level: a run's config checks each section with its package's own checks, below the loop that reads it
    "config": {"algos", "metrics", "models", "rollout", "routing", "run", "tasks"},
    "config_docs": {"algos", "config", "metrics", "models", "rollout", "routing", "run", "tasks"},
    "loop": {"algos", "config", "metrics", "models", "rollout", "routing", "run", "tasks"},
    "integrations": {"algos", "metrics", "models", "rollout", "routing", "tasks"},
    "train": _LOOP,
    "export": _LOOP,
    "analysis": {"metrics", "run"},
    "studies": {"analysis", "metrics", "run"},
    "report": _STUDIES,
    "drift_report": _STUDIES,
    # top level: commands that run training and read it as a study
    "forecast": _LOOP | {"train"} | _STUDIES,
    "reproduce": _LOOP | {"train"} | _STUDIES,
}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _layer_of(path: Path) -> str:
    """The package a module of moe_rl belongs to, or a top-level module's own name."""
    return path.relative_to(ROOT / "moe_rl").with_suffix("").parts[0]


def test_packages_import_only_the_layers_below_them() -> None:
    packages = {p.name for p in (ROOT / "moe_rl").iterdir() if (p / "__init__.py").is_file()}
    top_level = sorted(p.stem for p in (ROOT / "moe_rl").glob("*.py") if p.stem != "__init__")
    assert len(top_level) <= 8, f"at most eight top-level modules besides __init__: {top_level}"
    assert packages | set(top_level) == set(LAYERS), "a module without a layer: add it to LAYERS and docs/design.md §5"
    bad: dict[str, list[str]] = {}
    for path in sorted((ROOT / "moe_rl").rglob("*.py")):
        if path == ROOT / "moe_rl" / "__init__.py":
            continue
        layer, module = _layer_of(path), _module_name(path)
        used = {m.split(".")[1] for m in _imported_modules(path) if m.startswith("moe_rl.")}
        if wrong := sorted(used - LAYERS[layer] - {layer}):
            bad[module] = wrong
    assert bad == {}
    # the check sees top-level modules: config reads the loop's packages' checks, never the loop
    assert {"moe_rl.algos", "moe_rl.models"} <= _imported_modules(ROOT / "moe_rl" / "config.py")
    assert not LAYERS["config"] & {"loop", "train", "studies", "analysis", "integrations"}


def test_layers_are_an_order() -> None:
    """No two packages or top-level modules import each other, directly or through others: the layers sort."""
    left = {layer: allowed & set(LAYERS) for layer, allowed in LAYERS.items()}
    while ready := {layer for layer, below in left.items() if not below}:
        left = {layer: below - ready for layer, below in left.items() if layer not in ready}
    assert left == {}, f"a cycle among {sorted(left)}"


def _import_graph() -> dict[str, set[str]]:
    """Each module of moe_rl and the modules of moe_rl it imports: at any depth in the module (lazy imports inside
    functions included), except under `if TYPE_CHECKING:` (never run, so no circle at import time).

    `import a.b` is an edge to a.b; `from a import b` to the module a.b where there is one, else to a (the package's
    __init__). Importing a.b also runs the package a first; those implicit edges to enclosing packages are not drawn
    (a package's __init__ importing its own modules is its job). Imports by name at run time (`importlib`, as
    `moe_rl.tasks` does for its lazy names) are not seen."""
    paths = sorted((ROOT / "moe_rl").rglob("*.py"))
    modules = {_module_name(p) for p in paths}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for path in paths:
        me = _module_name(path)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        found: set[str | None] = set()
        todo: list[ast.AST] = [ast.parse(path.read_text())]
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo.extend(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
                found.update(resolve(f"{base}.{alias.name}") for alias in node.names)
            todo.extend(ast.iter_child_nodes(node))
        graph[me] = {m for m in found if m is not None and m != me}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that starts and ends at the same node, or None (depth-first, in name order)."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done and (cycle := visit(nxt)):
                return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_names_the_circle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_module_import_graph_has_no_cycles() -> None:
    """No module of moe_rl imports itself through others, lazily or not (a circle works only while each side's
    import stays inside a function, and says that the two belong in one layer or one module)."""
    graph = _import_graph()
    # the graph sees lazy imports, `from package import module`, and leaves out annotations under TYPE_CHECKING
    assert "moe_rl.models.megablocks" in graph["moe_rl.models"]
    assert "moe_rl.config" in graph["moe_rl.config_docs"]
    assert "moe_rl.config" not in graph["moe_rl.loop.keys"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
