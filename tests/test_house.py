"""The layout is the architecture: every import points down the layers, no module imports
itself through others, the kernel runs without torch, plugins reach the kernel only through
its public modules, and each import inside a function says why it is there.

Read from the source with `ast`, nothing is imported, so this runs in a second.
"""

from __future__ import annotations

import ast
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"core": "speckernel", "speculators": "speckernel.speculators", "platforms": "speckernel.platforms",
            "transports": "speckernel.transports"}

LAYERS: list[tuple[str, ...]] = [
    ("errors", "log", "progress", "config", "sampling_params", "outputs", "model_config"),
    ("attention", "platform", "transport", "plugin", "registry", "wire"),
    ("ops", "models"),
    ("kernel",),
    ("runner",),
    ("kit",),
    ("engine",),
    ("frontend", "conformance", "testing"),
    ("tools",),
    ("__init__", "__main__"),
]
"""Roles of speckernel's modules, lowest first: a module imports only its own role and the
roles below it (tools -> frontend -> engine -> kernel/runner -> ops/models -> contracts -> values)."""

PLUGIN_API = {
    "speculators": {"speckernel.plugin", "speckernel.kit", "speckernel.speculators"},
    "platforms": {"speckernel.platform", "speckernel.attention", "speckernel.ops", "speckernel.log",
                  "speckernel.platforms"},
    "transports": {"speckernel.transport", "speckernel.wire.codec", "speckernel.transports"},
}
"""What each plugin folder may import of speckernel: its contract, and the kit or building blocks
that contract hands it."""


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    if rest[-1] == "__init__":
        rest = rest[:-1]
    return ".".join([PACKAGES[folder], *rest])


MODULES = {module_name(p): p for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))}


def imported(name: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The project modules one import statement reads (a `from pkg import module` reads module)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.startswith("speckernel")}
    if node.level:
        base = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if not source.startswith("speckernel"):
        return set()
    return {f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names}


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(), str(MODULES[name]))


@cache
def imports(name: str) -> frozenset[str]:
    found: set[str] = set()
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found |= imported(name, node)
    return frozenset(m for m in found if m != name)


def role(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def rank(name: str) -> int:
    r = role(name)
    return next(i for i, roles in enumerate(LAYERS) if r in roles)


PLUGIN_FOLDERS = ("speculators", "platforms", "transports")
KERNEL = [m for m in MODULES if role(m) not in PLUGIN_FOLDERS]


def test_every_module_has_a_role() -> None:
    known = {r for roles in LAYERS for r in roles}
    assert not [m for m in KERNEL if role(m) not in known]


@pytest.mark.parametrize("name", KERNEL)
def test_imports_point_down(name: str) -> None:
    up = sorted(m for m in imports(name) if m in MODULES and role(m) in {r for rs in LAYERS for r in rs}
                and rank(m) > rank(name))
    assert not up, f"{name} ({role(name)}) imports a higher layer: {up}"


def test_the_kernel_never_imports_a_concrete_plugin() -> None:
    plugins = ("speckernel.speculators", "speckernel.platforms", "speckernel.transports")
    reached = {m: sorted(i for i in imports(m) if i.startswith(plugins)) for m in KERNEL}
    assert not {m: i for m, i in reached.items() if i}


@pytest.mark.parametrize("folder", sorted(PLUGIN_API))
def test_plugins_import_only_their_public_modules(folder: str) -> None:
    allowed = PLUGIN_API[folder]
    bad = {m: sorted(i for i in imports(m) if not any(i == a or i.startswith(a + ".") for a in allowed))
           for m in MODULES if m.startswith(PACKAGES[folder])}
    assert not {m: i for m, i in bad.items() if i}


def test_no_import_cycle() -> None:
    state: dict[str, int] = {}
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(imports(u) & MODULES.keys()):
            if state.get(v) == 1:
                cycles.append([*path[path.index(v):], v])
            elif v not in state:
                visit(v)
        path.pop()
        state[u] = 2

    for m in MODULES:
        if m not in state:
            visit(m)
    assert not cycles


def longest_chain() -> list[str]:
    @cache
    def chain(u: str) -> tuple[str, ...]:
        below = [chain(v) for v in imports(u) & MODULES.keys()]
        return (u, *max(below, key=len, default=()))

    return list(max((chain(m) for m in MODULES), key=len))


def test_layers_are_few() -> None:
    """The longest import chain, all imports counted (the flat layout had 16 layers and 3 cycles)."""
    chain = longest_chain()
    assert len(chain) <= 13, " -> ".join(chain)


def test_kernel_runs_without_torch() -> None:
    """The kernel (scheduler, ledger, blocks, frames) is plain Python: property tests and the
    frontend read it without torch."""
    heavy = {"torch", "triton", "numpy"}
    found = {}
    for m in MODULES:
        if role(m) != "kernel":
            continue
        names = set()
        for node in ast.walk(tree(m)):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
        if names & {"torch", "triton"}:
            found[m] = sorted(names & heavy)
    assert not found


def is_import_or_blank(line: str) -> bool:
    return not line.strip() or line.strip().startswith(("import ", "from "))


def function_imports(name: str) -> list[tuple[int, str]]:
    """Imports inside a function, with the comment that says why (on the line or the one above)."""
    path = MODULES[name]
    comments: dict[int, str] = {}
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    line = inner.lineno  # a block of imports shares the comment above its first line
                    while line > 1 and line not in comments and is_import_or_blank(lines[line - 2]):
                        line -= 1
                    found.append((inner.lineno, comments.get(line) or comments.get(line - 1, "")))
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_import_inside_a_function_says_why(name: str) -> None:
    silent = [line for line, why in function_imports(name) if not why]
    assert not silent, f"{MODULES[name].relative_to(ROOT)}: imports inside functions without a why at lines {silent}"


def names_used(node: ast.AST) -> set[str]:
    """Every name a piece of code imports or reads (`HostRows`, `plugin.HostRows`)."""
    found: set[str] = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.ImportFrom):
            found |= {a.name for a in inner.names}
        elif isinstance(inner, ast.Name):
            found.add(inner.id)
        elif isinstance(inner, ast.Attribute):
            found.add(inner.attr)
    return found


def test_in_step_drafting_never_sees_host_rows() -> None:
    """A speculator that drafts inside the step reads device tensors only: in the runner, only the
    drafting passes' module names the step's host rows (`HostRows`), and there neither the
    in-step pass nor the no-drafting one does; the after-step pass does (or the rule checks nothing)."""
    runner = [m for m in MODULES if role(m) == "runner"]
    assert {m for m in runner if "HostRows" in names_used(tree(m))} == {"speckernel.runner.drafting"}
    classes = {node.name: node for node in tree("speckernel.runner.drafting").body if isinstance(node, ast.ClassDef)}
    assert "HostRows" not in names_used(classes["InStepDrafting"]) | names_used(classes["NoDrafting"])
    assert "HostRows" in names_used(tree("speckernel.runner.drafting")) - names_used(classes["InStepDrafting"])
