"""The package's layering: every import points down, and no two files import each other.

Each folder of ``tightfit/`` is one level. A module may import its own folder and the folders
listed before its own in :data:`LEVELS`; nothing else of tightfit. Lazy imports inside
functions and ``TYPE_CHECKING`` imports count too: a dependency is a dependency. Run this file
alone (``pytest tests/test_layers.py -q``) to list the offending imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tightfit"

# Lowest first. ``tightfit`` itself (the lazy public API) and ``cli`` sit above everything.
LEVELS: tuple[str, ...] = (
    "measure",      # live-byte tracker, sizes, dtype names: anyone may import it
    "model",        # the model as a chain of blocks (decoder layers): find_blocks
    "integrity",    # checksums, the interrupt guard, owned files and atomic temps
    "tiers",        # device / host / disk places and the copy engines between them
    "loss",         # chunked LM head + cross-entropy
    "checkpoint",   # activation recompute/offload/tiling: profile, plans, solver, long steps
    "paging",       # the page store of optimizer state: layout, store, slab, sweep, disk
    "pressure",     # memory probes, cgroup, target, occupancy control, spike watch
    "optim",        # the paged optimizers, their DTensor glue and the registry
    "qlora",        # prepare(): NF4 + DQ via bitsandbytes, LoRA via peft
    "report",       # the measured per-piece report
    "planner",      # shapes/presets, memory model, ladder, table, verify, `tightfit plan`
    "distributed",  # torchrun launch, FSDP2/DDP wrapping, DCP, selfcheck
    "train",        # the loop, data, resume state, plots, the torchrun job
    "cli",          # `tightfit …`
    "__main__",     # `python -m tightfit`: the same command line
    "",             # tightfit/__init__.py: the public API
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def _resolve(name: str) -> str | None:
    """The module file an imported dotted name lands in (a package → its ``__init__``)."""
    while name:
        if _is_package(name) or (PACKAGE.parent / (name.replace(".", "/") + ".py")).exists():
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """``(line, module)`` for every tightfit module the file imports, lazily or not.

    ``source`` stands in for the file's text (the checker's own tests use it).
    """
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    text = path.read_text() if source is None else source
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import submodule`` imports the submodule; otherwise the package
            names = [f"{base}.{a.name}" if _resolve(f"{base}.{a.name}") == f"{base}.{a.name}"
                     else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "tightfit" and (target := _resolve(name)) is not None:
                found.append((node.lineno, target))
    return found


def level_of(module: str) -> int:
    parts = module.split(".")
    folder = parts[1] if len(parts) > 1 else ""
    return LEVELS.index(folder)


def _modules() -> dict[str, list[tuple[int, str]]]:
    return {_module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_folder_has_a_level() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert folders | modules == set(LEVELS) - {""}


def test_no_import_runs_upward() -> None:
    upward = [
        f"{module}:{line} imports {target} ({LEVELS[level_of(target)] or 'tightfit'} is above "
        f"{LEVELS[level_of(module)] or 'tightfit'})"
        for module, deps in _modules().items()
        for line, target in deps
        if level_of(target) > level_of(module)
    ]
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_import_cycle_between_files() -> None:
    graph = {m: {t for _, t in deps if t != m} for m, deps in _modules().items()}
    # Tarjan's strongly connected components; any component of two or more files is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles between files:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_check_sees_lazy_relative_and_type_checking_imports() -> None:
    # The checker itself, on made-up sources placed in the paging folder: every kind of
    # import that runs upward must be found, resolved to its file and judged upward.
    here = PACKAGE / "paging" / "store.py"
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from tightfit.optim.base import PagedOptimizer\n"
        "def f():\n    from tightfit.train import loop\n"
        "from ..planner import ladder\n"
        "import tightfit.report.report\n"
        "from . import layout\n"
    )
    found = {t: line for line, t in imports_of(here, source)}
    assert found == {"tightfit.optim.base": 3, "tightfit.train.loop": 5,
                     "tightfit.planner.ladder": 6, "tightfit.report.report": 7,
                     "tightfit.paging.layout": 8}
    upward = {t for t in found if level_of(t) > level_of("tightfit.paging.store")}
    assert upward == {"tightfit.optim.base", "tightfit.train.loop", "tightfit.planner.ladder",
                      "tightfit.report.report"}


# 500, not 400: one concept per module over splitting by the cap. The paged optimizer's base
# (the class with its memory API, tightfit/optim/base.py) and the 8-bit base with its state-dict
# loading (tightfit/optim/paged8bit.py) were split across files only to pass 400.
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{name}: {text.count(chr(10))} lines (> {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}(): {n} lines "
                                    f"(> {MAX_FUNCTION_LINES})")
    assert not too_long, "split these:\n" + "\n".join(too_long)


def private_imports_of(path: Path, source: str | None = None) -> list[str]:
    """``"line: name"`` for every ``_private`` name the file imports from another folder (a
    private name is its own folder's business; make it public where another folder needs it).
    Monkeypatching in tests is not an import and is not counted."""
    module = _module_name(path)
    folder = module.split(".")[1] if module.count(".") else ""
    text = path.read_text() if source is None else source
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        parts = node.module.split(".")
        if parts[0] != "tightfit" or (parts[1] if len(parts) > 1 else "") == folder:
            continue
        found += [f"{node.lineno}: {node.module}.{a.name}" for a in node.names
                  if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_a_private_name_of_another_folder() -> None:
    private = [f"{p.relative_to(PACKAGE.parent)}:{hit}" for p in sorted(PACKAGE.rglob("*.py"))
               for hit in private_imports_of(p)]
    assert not private, "private names imported across folders:\n" + "\n".join(private)
    here = PACKAGE / "train" / "step.py"  # the check itself can fail
    assert private_imports_of(here, "from tightfit.qlora.quantize import _heads, ok\n"
                                    "from tightfit.train.loop import _own\n") == [
        "1: tightfit.qlora.quantize._heads"]
