"""The layout is the architecture: every import points down the layers, no module imports
itself through others, the kernel runs without torch, plugins reach the kernel only through
its public modules, and each import inside a function says why it is there.

Read from the source with `ast`, nothing is imported, so this runs in a second.
"""

from __future__ import annotations

import ast
import re
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


def named_plugin_loads(source: ast.Module) -> list[str]:
    """`registry.load(kind, "<a name>")` calls: a plugin chosen by the code, not by configuration."""
    found = []
    for node in ast.walk(source):
        name = node.func.attr if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else \
            node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None
        if (isinstance(node, ast.Call) and name == "load"
                and len(node.args) == 2 and all(isinstance(a, ast.Constant) for a in node.args)
                and node.args[0].value == "transport"):
            found.append(f"line {node.lineno}: load({node.args[0].value!r}, {node.args[1].value!r})")
    return found


LOOPBACK = re.compile(r"127\.0\.0\.1|\blocalhost\b|\[::1\]")
"""A loopback address in a string: where stages meet comes from configuration (whose default is one)
or the rendezvous, never from the engine."""


PIPELINE = [m for m in KERNEL if m.rsplit(".", 1)[-1].startswith(("stage", "core")) and role(m) in ("engine", "runner")]
"""The modules of pipeline stages and the engine core that starts them."""


def test_the_engine_never_names_a_transport_nor_a_loopback_address() -> None:
    """Configuration (or the platform's preference) picks the transport, loaded by name from the
    registry; every address a stage uses comes from configuration or the rendezvous."""
    named = {m: found for m in KERNEL if (found := named_plugin_loads(tree(m)))}
    assert not named, named
    loopback = {m: [i + 1 for i, line in enumerate(MODULES[m].read_text().splitlines()) if LOOPBACK.search(line)]
                for m in PIPELINE}
    assert not {m: lines for m, lines in loopback.items() if lines}


@pytest.mark.parametrize("source", ['registry.load("transport", "zmq")', "load('transport', 'torch_dist')(group)"])
def test_the_transport_rule_catches_a_named_transport(source: str) -> None:
    assert named_plugin_loads(ast.parse(source))


def test_the_transport_rule_allows_a_configured_one() -> None:
    assert not named_plugin_loads(ast.parse('registry.load("transport", config.pipeline_transport)'))
    assert LOOPBACK.search('f"tcp://127.0.0.1:*"') and not LOOPBACK.search('f"tcp://{host}:*"')


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


# --- the request's state machine: its fields change only through its transitions --------------

REQUEST_ROOM = "speckernel.kernel.request"
REQUEST_NAMES = {"req", "request"}
"""Names that hold a request wherever they appear (unless annotated as something else)."""
REQUEST_HOLDERS = {"requests", "running", "waiting"}
"""The scheduler's collections of requests: an item read from one is a request."""
CONTAINER_MUTATORS = {"append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft", "remove",
                      "clear", "sort", "reverse", "rotate", "update", "setdefault", "popitem", "add", "discard",
                      "__setitem__", "__delitem__", "__iadd__"}


@cache
def request_facts() -> tuple[frozenset[str], frozenset[str]]:
    """(the Request's fields, the methods that change a field's value in place: those of lists,
    dicts, sets and deques, and those of the other classes of the request's module, such as its
    speculation counters, that write an attribute of self)."""
    classes = {c.name: c for c in tree(REQUEST_ROOM).body if isinstance(c, ast.ClassDef)}
    fields = {n.target.id for n in classes["Request"].body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    own = {f.name for name, c in classes.items() if name != "Request" for f in c.body
           if isinstance(f, ast.FunctionDef) and any(
               isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
               and isinstance(t.ctx, ast.Store | ast.Del) for t in ast.walk(f))}
    return frozenset(fields), frozenset(CONTAINER_MUTATORS | own)


def names_typed(scope: ast.AST) -> dict[str, bool]:
    """Names whose kind a scope tells (nested scopes included): annotated (parameters, annotated
    assignments: whether the annotation names Request), or bound to a request (assigned one, or
    the loop variable over one of the scheduler's collections)."""
    typed: dict[str, bool] = {}
    for node in ast.walk(scope):
        match node:
            case ast.arg(arg=name, annotation=ast.expr() as annotation) | \
                    ast.AnnAssign(target=ast.Name(id=name), annotation=annotation):
                typed[name] = re.search(r"\bRequest\b", ast.unparse(annotation)) is not None
            case ast.Assign(targets=[ast.Name(id=name)], value=value) if is_request(value, {}):
                typed.setdefault(name, True)
            case ast.For(target=ast.Name(id=name), iter=items) | \
                    ast.comprehension(target=ast.Name(id=name), iter=items) if holds_requests(items):
                typed.setdefault(name, True)
    return typed


def holder(node: ast.expr) -> bool:
    """One of the scheduler's collections of requests."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name in REQUEST_HOLDERS


def holds_requests(node: ast.expr) -> bool:
    """What a loop over requests iterates: a collection of requests, or its values()."""
    match node:
        case ast.Call(func=ast.Attribute(attr="values", value=value)):
            return holder(value)
    return holder(node)


def is_request(node: ast.expr, typed: dict[str, bool]) -> bool | None:
    """True: the expression is a request; False: it is known to be something else; None: unknown."""
    match node:
        case ast.Name(id=("self" | "cls")):
            return False
        case ast.Name(id=name):
            return typed[name] if name in typed else (True if name in REQUEST_NAMES else None)
        case ast.Attribute(attr=attr) if attr in REQUEST_NAMES:
            return True
        case ast.Subscript(value=value) if holder(value):
            return True
        case ast.Call(func=ast.Name(id="Request")):
            return True
        case ast.Call(func=ast.Attribute(attr=("get" | "pop" | "popleft"), value=value)) if holder(value):
            return True
    return None


def writes_a_request(target: ast.expr, typed: dict[str, bool], fields: frozenset[str]) -> bool:
    """Does writing through target (storing to it, or changing it in place) write a request field?
    Every object on its attribute chain counts: a request, or an object of unknown type whose
    attribute has a request field's name."""
    while isinstance(target, ast.Attribute | ast.Subscript):
        if isinstance(target, ast.Attribute):
            verdict = is_request(target.value, typed)
            if verdict or (verdict is None and target.attr in fields):
                return True
        target = target.value
    return False


def written(node: ast.AST, typed: dict[str, bool], mutators: frozenset[str]) -> list[ast.expr]:
    """What a statement or call writes through: assignment and delete targets, the receiver of an
    in-place change, the object of a setattr."""
    match node:
        case ast.Assign(targets=many) | ast.Delete(targets=many):
            return list(many)
        case ast.AugAssign(target=one) | ast.AnnAssign(target=one):
            return [one]
        case ast.Call(func=ast.Attribute(attr=method, value=receiver)) if method in mutators:
            return [receiver] if isinstance(receiver, ast.Attribute | ast.Subscript) else []
        case ast.Call(func=ast.Name(id=("setattr" | "delattr")), args=[obj, attr, *_]):
            name = attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str) else "?"
            return [ast.Attribute(obj, name, ast.Store())]
    return []


def request_writes(module: ast.Module) -> list[str]:
    """Stores, augmented stores, deletes and in-place changes of a request's fields in a module; a
    name's annotation is read in the innermost function that has it."""
    fields, mutators = request_facts()
    found: set[tuple[int, str]] = set()

    def visit(node: ast.AST, typed: dict[str, bool]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            typed = typed | names_typed(node)
        targets = written(node, typed, mutators)
        while targets:
            t = targets.pop()
            if isinstance(t, ast.Tuple | ast.List | ast.Starred):
                targets += t.elts if isinstance(t, ast.Tuple | ast.List) else [t.value]
            elif writes_a_request(t, typed, fields):
                found.add((getattr(node, "lineno", 0), ast.unparse(node).splitlines()[0]))
        for child in ast.iter_child_nodes(node):
            visit(child, typed)

    visit(module, {})
    return [f"line {line}: {text}" for line, text in sorted(found)]


def test_request_fields_change_only_through_its_transitions() -> None:
    """Requests change state only through the named transitions of `kernel/request.py` (schedule a
    row, land and apply a result, roll back, reset drafts, preempt, finish, ...): the scheduler,
    the ledger, the block manager and the engine call them, none writes a field."""
    writes = {m: w for m in MODULES if m != REQUEST_ROOM and (w := request_writes(tree(m)))}
    assert not writes, f"request fields written outside {REQUEST_ROOM}: {writes}"


PLANTED = [
    "def f(req):\n    req.num_computed_tokens -= 1\n",
    "def f(sched, key):\n    sched.requests[key].num_draft_slots = 3\n",
    "def f(self, key):\n    self.requests.get(key).status = None\n",
    "def f(a: Request | None, n):\n    a.in_flight, a.num_placeholders = n, n\n",
    "def f(victim):\n    victim.generation = 0\n",
    "def f(req, t):\n    req.output_token_ids.append(t)\n",
    "def f(req):\n    req.spec.num_invalid_drafts += 1\n",
    "def f(r):\n    r.spec.record(1, 1)\n",
    "def f(self):\n    self.req.block_ids[0] = 7\n",
    "def f(self):\n    for req in self.running:\n        req.new_field = 1\n",
    "def f(self):\n    victim = self.running[-1]\n    victim.new_field = 1\n",
    "def f(self):\n    for r in self.requests.values():\n        r.new_field = 1\n",
    "def f(obj):\n    setattr(obj, 'num_unverified', 0)\n",
    "def f(req):\n    setattr(req, 'slot', 1)\n",
    "def f(req):\n    del req.grammar\n",
]
"""Writes the house rule must catch: by name, through the scheduler's collections, by annotation,
by a request field's name on an object of unknown type, in place, through setattr."""

ALLOWED = [
    "def f(self, spec):\n    self.spec = spec\n    self.requests[1] = 2\n",
    "def f(args: argparse.Namespace):\n    args.params = 1\n",
    "def f(req):\n    req.schedule_row(0, 1, 0)\n    x = req.num_tokens\n",
]
"""Reads, transitions, an object's own attributes, and an attribute named like a field on an
object annotated as something else."""


@pytest.mark.parametrize("source", PLANTED)
def test_the_request_rule_catches_a_planted_write(source: str) -> None:
    assert request_writes(ast.parse(source)), source


@pytest.mark.parametrize("source", ALLOWED)
def test_the_request_rule_allows_reads_and_transitions(source: str) -> None:
    assert not request_writes(ast.parse(source)), source
