"""The prompt corpus for self-distilling drafters: one-turn chats for the target to answer.

Drafters learn to predict what the target model says, so they should see the kind of text they
will draft at evaluation time. The evaluation set is HumanEval (164 Python function stubs asked
as chat, see `datasets.humaneval_messages`), and it must never leak into training, neither its
prompts nor its problems. So the corpus is made from two sources that are not HumanEval:

* stubs of functions from the Python standard library that ships with the running interpreter
  (`def name(args) -> ann:` and the docstring, no body): the same shape as a HumanEval prompt,
  taken from code nobody wrote for a benchmark. About half are asked with the HumanEval phrasing
  ("Complete this Python function."), the rest with other phrasings, so the drafters are not
  tied to one wording. Functions that share a name with a HumanEval entry point are left out.
* optionally, stubs of the functions of installed packages (`--package numpy --package sympy ...`),
  chosen the same way: code written for libraries, not benchmarks, in far greater number and
  variety than the stdlib alone (about 2,500 stubs). A corpus with packages depends on their
  versions, which `main` prints.
* hand-written requests (`INSTRUCTIONS`), written for this module: programming (functions,
  classes, bugs, SQL, shell, regex, algorithms, tests) and general (explanations, summaries,
  stories, emails, word problems), chosen to avoid the HumanEval problems. When a corpus needs
  more of them than there are, they come back with a different opening or closing sentence.

The default mix is about 75% code (stubs 65%, programming requests 10%) and 25% general
(`--general-share`, `--programming-share`). A corpus is deterministic for a seed, an interpreter
version (the stubs come from its stdlib) and the versions of the packages it draws on.

The hand-written text (requests, stub phrasings, openings and closings, the HumanEval entry points
left out) is data, not code: it lives in `corpus_prompts.json` beside this module, shipped as
package data and read once on import, so it can be read, edited and reviewed apart from the logic.

    python -m speckernel.tools.train.corpus --out corpus.jsonl.gz --count 8000 [--seed 0] [--package NAME ...]
"""

from __future__ import annotations

import argparse
import ast
import functools
import gzip
import importlib.metadata
import importlib.resources
import importlib.util
import io
import json
import os
import random
import re
import sys
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Conversation = list[dict[str, str]]

GENERAL_SHARE = 0.25
PROGRAMMING_SHARE = 0.10  # hand-written programming requests; stubs are the rest of the code share

MIN_DOCSTRING = 40
MAX_DOCSTRING = 2000  # longer docstrings are manuals, not function descriptions
PACKAGE_MAX_DOCSTRING = 1200  # library docstrings run long; a prompt should leave room for its answer
PER_PACKAGE = 2500  # stubs from one package at most, so a few big ones do not make up the corpus
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "tkinter", "lib2to3", "ensurepip", "site-packages",
                       "dist-packages", "turtledemo", "__pycache__"})

PROMPTS_FILE = "corpus_prompts.json"
"""The corpus's prompt data, a file of this package (package data)."""


def read_data(name: str) -> dict[str, Any]:
    """A JSON object from a data file of this package."""
    folder = importlib.resources.files(__package__) if __package__ else Path(__file__).parent  # run as a script
    data = json.loads(folder.joinpath(name).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{name}: not a JSON object")
    return data


def texts(data: dict[str, Any], key: str, name: str) -> tuple[str, ...]:
    """data[key], which must be a non-empty list of strings (name: the file, for the error)."""
    value = data.get(key)
    if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise ValueError(f"{name}: {key!r} must be a non-empty list of strings")
    return tuple(value)


@dataclass(frozen=True)
class Prompts:
    """The hand-written text of the corpus, as PROMPTS_FILE holds it."""

    humaneval_entry_points: frozenset[str]
    stub_templates: tuple[str, ...]
    """The phrasings of a stub prompt ({stub}, {name}), HumanEval's first."""
    programming_instructions: tuple[str, ...]
    general_instructions: tuple[str, ...]
    openings: tuple[str, ...]
    closings: tuple[str, ...]


@functools.cache
def prompts() -> Prompts:
    """PROMPTS_FILE, read once."""
    data = read_data(PROMPTS_FILE)
    humaneval = data.get("humaneval_template")
    if not (isinstance(humaneval, str) and humaneval):
        raise ValueError(f"{PROMPTS_FILE}: 'humaneval_template' must be a non-empty string")
    return Prompts(
        humaneval_entry_points=frozenset(texts(data, "humaneval_entry_points", PROMPTS_FILE)),
        stub_templates=(humaneval, *texts(data, "other_stub_templates", PROMPTS_FILE)),
        programming_instructions=texts(data, "programming_instructions", PROMPTS_FILE),
        general_instructions=texts(data, "general_instructions", PROMPTS_FILE),
        openings=texts(data, "openings", PROMPTS_FILE),
        closings=texts(data, "closings", PROMPTS_FILE),
    )


# The HumanEval entry points: a stub with one of these names is left out, so that no training
# prompt asks for a function the evaluation asks for. (Names only, used to exclude; the test
# checks this set against the real data when it is cached.)
HUMANEVAL_ENTRY_POINTS = prompts().humaneval_entry_points
HUMANEVAL_TEMPLATE = prompts().stub_templates[0]
STUB_TEMPLATES = prompts().stub_templates
PROGRAMMING_INSTRUCTIONS = prompts().programming_instructions
GENERAL_INSTRUCTIONS = prompts().general_instructions
INSTRUCTIONS = PROGRAMMING_INSTRUCTIONS + GENERAL_INSTRUCTIONS
# A reused request gets one of these around it, so each use is a different prompt.
OPENINGS = prompts().openings
CLOSINGS = prompts().closings


def python_files(root: str | os.PathLike[str]) -> Iterator[Path]:
    """The .py files under root in sorted order (tests and GUI/tooling packages left out), so the
    stubs come out the same on every run."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("test_"):
                yield Path(folder) / name


def stdlib_files(root: str | None = None) -> Iterator[Path]:
    return python_files(root or sysconfig.get_paths()["stdlib"])


_LOGIC = (ast.BoolOp, ast.BinOp, ast.Compare, ast.IfExp, ast.ListComp, ast.SetComp, ast.DictComp,
          ast.GeneratorExp)


def _body_is_trivial(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Nothing to implement after the docstring: no statement, or a single one that is not a
    `return` of some logic (pass, `...`, a raise, a getter, a plain delegating call)."""
    body = node.body[1:]
    if sum(isinstance(n, ast.stmt) for s in body for n in ast.walk(s)) >= 2:
        return False
    if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
        return not any(isinstance(n, _LOGIC) for n in ast.walk(body[0].value))
    return True


def _clean_docstring(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The docstring as `ast.get_docstring` cleans it, less trailing spaces and blank lines (which
    Python 3.11's cleaning leaves in some docstrings)."""
    doc = ast.get_docstring(node, clean=True)
    return None if doc is None else "\n".join(line.rstrip() for line in doc.split("\n")).rstrip("\n")


def _quote_docstring(doc: str) -> str:
    """The docstring as a triple-quoted literal indented for a function body, HumanEval-style
    (closing quotes on their own line when it spans lines)."""
    prefix = "r" if "\\" in doc else ""
    lines = doc.split("\n")
    if len(lines) == 1 and not doc.endswith(('"', "\\")):
        return f'    {prefix}"""{doc}"""\n'
    body = "\n".join(f"    {line}" if line else "" for line in lines)
    return f'    {prefix}"""{body.lstrip()}\n    """\n'


def render_stub(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """`def name(args) -> ann:` and the docstring, or None when the docstring cannot be written
    back exactly (it contains triple quotes or control characters)."""
    doc = _clean_docstring(node)
    if doc is None or '"""' in doc or any(not (c.isprintable() or c == "\n") for c in doc):
        return None
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    stub = f"{keyword} {node.name}({ast.unparse(node.args)}){returns}:\n{_quote_docstring(doc)}"
    try:
        parsed = ast.parse(stub + "    pass\n").body[0]
    except SyntaxError:
        return None
    if not isinstance(parsed, ast.FunctionDef | ast.AsyncFunctionDef) or _clean_docstring(parsed) != doc:
        return None
    return stub


def _candidates(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Top-level functions and the methods of top-level public classes."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from (m for m in node.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef))


def _keep(node: ast.FunctionDef | ast.AsyncFunctionDef, max_docstring: int = MAX_DOCSTRING) -> bool:
    doc = _clean_docstring(node) or ""
    return (not node.name.startswith("_") and node.name.lower() not in _BLOCKED_NAMES
            and MIN_DOCSTRING <= len(doc) <= max_docstring and not _body_is_trivial(node))


_BLOCKED_NAMES = frozenset(name.lower() for name in HUMANEVAL_ENTRY_POINTS)
# A definition of an entry point anywhere in a stub (docstring examples define helpers too).
_DEFINES_BLOCKED = re.compile(
    rf"^\s*(?:async\s+)?def\s+(?:{'|'.join(sorted(map(re.escape, HUMANEVAL_ENTRY_POINTS)))})\s*\(", re.M | re.I)


def _stubs_in(files: Iterator[Path], max_docstring: int = MAX_DOCSTRING) -> tuple[str, ...]:
    """The distinct stubs of the kept functions in files, in file order."""
    stubs: dict[str, None] = {}
    for path in files:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes and the like in old modules
                tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue
        for node in _candidates(tree):
            if _keep(node, max_docstring) and (stub := render_stub(node)) is not None \
                    and not _DEFINES_BLOCKED.search(stub):
                stubs.setdefault(stub, None)
    return tuple(stubs)


@functools.cache
def _all_stdlib_functions() -> tuple[str, ...]:
    return _stubs_in(stdlib_files())


def stdlib_functions(limit: int | None = None) -> list[str]:
    """HumanEval-shaped stubs (signature and docstring, no body) of the running interpreter's
    stdlib functions: prompts of the evaluation's shape from code that is not the evaluation.
    The first `limit` of them, in file order, or all."""
    stubs = _all_stdlib_functions()
    return list(stubs if limit is None else stubs[:limit])


def package_version(package: str) -> str:
    """The installed version of the distribution that provides an importable package."""
    for dist in importlib.metadata.packages_distributions().get(package, [package]):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


@functools.cache
def package_functions(package: str, limit: int = PER_PACKAGE) -> tuple[str, ...]:
    """Stubs of an installed package's functions, chosen like the stdlib's (docstrings up to
    PACKAGE_MAX_DOCSTRING): at most `limit`, a seeded sample spread over the whole package, in
    file order. A package that is not installed is an error, not an empty source."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"no installed package named {package!r} (a package, not a single module)")
    stubs = [s for root in sorted(spec.submodule_search_locations)
             for s in _stubs_in(python_files(root), PACKAGE_MAX_DOCSTRING)]
    stubs = list(dict.fromkeys(stubs))
    if len(stubs) > limit:
        keep = set(random.Random(package).sample(range(len(stubs)), limit))
        stubs = [s for i, s in enumerate(stubs) if i in keep]
    return tuple(stubs)


SAMPLED_STUBS = 200
"""A corpus that needs at most this many stubs (and none from packages) takes them from a seeded
sample of the stdlib's files rather than from all of them: parsing the whole stdlib takes seconds
(ten on a busy two-core host), a large share of a short run on a CPU."""


def sampled_stdlib_functions(n: int, seed: int) -> list[str]:
    """At least n distinct stubs (all there are, if fewer), chosen like `stdlib_functions`, from
    the stdlib's files taken in an order shuffled by seed, in that order."""
    files = list(stdlib_files())
    random.Random(seed).shuffle(files)
    stubs: dict[str, None] = {}
    for path in files:
        if len(stubs) >= n:
            break
        stubs.update(dict.fromkeys(_stubs_in(iter([path]))))
    return list(stubs)


def all_stubs(packages: Sequence[str] = (), per_package: int = PER_PACKAGE) -> list[str]:
    """The stdlib's stubs, then each package's that are new, in the order given."""
    stubs = dict.fromkeys(stdlib_functions())
    for package in packages:
        stubs.update(dict.fromkeys(package_functions(package, per_package)))
    return list(stubs)


def corpus_mix(count: int, general_share: float = GENERAL_SHARE,
               programming_share: float = PROGRAMMING_SHARE, have_stubs: bool | None = None) -> dict[str, int]:
    """How many conversations of `count` come from each source."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not (0 <= general_share and 0 <= programming_share and general_share + programming_share <= 1):
        raise ValueError(f"shares must be >= 0 and sum to at most 1, got general {general_share} "
                         f"and programming {programming_share}")
    general = round(count * general_share)
    programming = round(count * programming_share)
    if not (bool(stdlib_functions()) if have_stubs is None else have_stubs):  # requests cover code
        return {"stubs": 0, "programming": count - general, "general": general}
    return {"stubs": count - general - programming, "programming": programming, "general": general}


def _requests(pool: Sequence[str], n: int, rng: random.Random) -> list[str]:
    """n requests from pool: each one once, as written, before any comes back; a request that
    comes back is wrapped in an opening and a closing not used for it before (while any are left),
    so every use is a different prompt."""
    combos = [(o, c) for o in OPENINGS for c in CLOSINGS if o or c]
    variations: dict[str, list[tuple[str, str]]] = {}
    out: list[str] = []
    use = 0
    while len(out) < n:
        order = list(pool)
        rng.shuffle(order)
        for text in order[: n - len(out)]:
            if use == 0:
                out.append(text)
                continue
            if text not in variations:
                variations[text] = rng.sample(combos, len(combos))
            opening, closing = variations[text][(use - 1) % len(combos)]
            joiner = "\n\n" if "\n" in text else " "
            out.append(opening + (text + joiner + closing if closing else text))
        use += 1
    return out


def _stub_prompts(stubs: Sequence[str], n: int, rng: random.Random) -> list[str]:
    """n stub prompts: every stub once before any comes back, and in a different phrasing each
    time. Each stub has the HumanEval phrasing on its first or its second appearance (alternating
    stub to stub), so about half the stub prompts use it while stubs appear at most twice."""
    order = list(stubs)
    rng.shuffle(order)
    phrasings = []
    for k in range(len(order)):
        others = rng.sample(range(1, len(STUB_TEMPLATES)), len(STUB_TEMPLATES) - 1)
        phrasings.append([0, *others] if k % 2 == 0 else [others[0], 0, *others[1:]])
    out = []
    for k in range(n):
        stub, turn = order[k % len(order)], k // len(order)
        template = STUB_TEMPLATES[phrasings[k % len(order)][turn % len(STUB_TEMPLATES)]]
        name = stub.split("def ", 1)[1].split("(", 1)[0]
        out.append(template.format(stub=stub, name=name))
    return out


def build_corpus(count: int, seed: int = 0, packages: Sequence[str] = (), *,
                 general_share: float = GENERAL_SHARE, programming_share: float = PROGRAMMING_SHARE,
                 per_package: int = PER_PACKAGE) -> list[Conversation]:
    """`count` one-turn user chats, shuffled, by default about 75% code and 25% general; the same
    for the same seed (interpreter and package versions). Stubs come from the stdlib and from
    `packages`, each used once before any comes back; a small corpus draws its stubs from a
    seeded sample of the stdlib's files (`SAMPLED_STUBS`)."""
    wanted = corpus_mix(count, general_share, programming_share, have_stubs=True)["stubs"]
    stubs = sampled_stdlib_functions(2 * wanted, seed) if not packages and wanted <= SAMPLED_STUBS \
        else all_stubs(packages, per_package)
    mix = corpus_mix(count, general_share, programming_share, have_stubs=bool(stubs))
    rng = random.Random(seed)
    prompts = (_stub_prompts(stubs, mix["stubs"], rng) if mix["stubs"] else []) + \
        _requests(PROGRAMMING_INSTRUCTIONS, mix["programming"], rng) + \
        _requests(GENERAL_INSTRUCTIONS, mix["general"], rng)
    rng.shuffle(prompts)
    return [[{"role": "user", "content": p}] for p in prompts]


def write_corpus(path: str | os.PathLike[str], conversations: Sequence[Conversation]) -> None:
    """JSON Lines, one {"messages": [...]} per line; gzip when the name ends in .gz (with mtime 0,
    so the same corpus is the same bytes)."""
    lines = (json.dumps({"messages": messages}, ensure_ascii=False) + "\n" for messages in conversations)
    if not str(path).endswith(".gz"):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(lines)
        return
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
            io.TextIOWrapper(gz, encoding="utf-8") as f:
        f.writelines(lines)


def read_corpus(path: str | os.PathLike[str]) -> list[Conversation]:
    """The conversations `write_corpus` wrote."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Write a corpus to a file, for a training run to read back with `read_corpus`."""
    parser = argparse.ArgumentParser(prog="python -m speckernel.tools.train.corpus",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="output file (.jsonl, or .jsonl.gz for gzip)")
    parser.add_argument("--count", type=int, required=True, help="number of conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--package", action="append", default=[], metavar="NAME",
                        help="also draw stubs from this installed package (repeatable)")
    parser.add_argument("--per-package", type=int, default=PER_PACKAGE, help="stubs from one package at most")
    parser.add_argument("--general-share", type=float, default=GENERAL_SHARE)
    parser.add_argument("--programming-share", type=float, default=PROGRAMMING_SHARE)
    args = parser.parse_args(argv)
    if args.count < 0:
        parser.error(f"--count must be >= 0, got {args.count}")
    try:
        conversations = build_corpus(args.count, args.seed, args.package, general_share=args.general_share,
                                     programming_share=args.programming_share, per_package=args.per_package)
        stubs = all_stubs(args.package, args.per_package)
        mix = corpus_mix(args.count, args.general_share, args.programming_share, have_stubs=bool(stubs))
    except ValueError as e:
        parser.error(str(e))
    write_corpus(args.out, conversations)
    sources = [f"{len(stdlib_functions())} from the stdlib of Python {sys.version_info.major}.{sys.version_info.minor}"]
    sources += [f"{len(package_functions(p, args.per_package))} from {p} {package_version(p)}" for p in args.package]
    print(f"train_corpus: wrote {len(conversations)} conversations to {args.out} (seed {args.seed}): "
          f"{mix['stubs']} function stub prompts (from {len(stubs)} "
          f"distinct stubs: {', '.join(sources)}), {mix['programming']} programming and "
          f"{mix['general']} general hand-written requests (from {len(PROGRAMMING_INSTRUCTIONS)} and "
          f"{len(GENERAL_INSTRUCTIONS)} distinct)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
