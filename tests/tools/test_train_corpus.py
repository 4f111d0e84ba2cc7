"""The drafter training corpus: deterministic, the intended mix, and nothing of HumanEval in it."""

from __future__ import annotations

import ast
import gzip
import importlib.resources
import json
import re
from pathlib import Path

import pytest

from speckernel.tools.train import corpus as tc

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds the module's fixtures

FENCE = "```python\n"


@pytest.fixture(scope="module")
def stubs() -> list[str]:
    return tc.stdlib_functions()


@pytest.fixture(scope="module")
def package_stubs() -> list[str]:
    return list(tc.package_functions("jinja2"))


@pytest.fixture(scope="module")
def corpus() -> list[list[dict[str, str]]]:
    # 8000 is more than the stubs and the requests on hand, so repeats and variations are covered.
    return tc.build_corpus(8000, seed=0)


@pytest.fixture(scope="module")
def humaneval() -> list[dict[str, str]]:
    """The HumanEval problems if they are already cached; never downloaded here."""
    try:
        from speckernel.models.builtin import fetch
        from speckernel.models.cache import cache_dir
        from speckernel.tools.datasets import HUMANEVAL

        if not (cache_dir() / Path(HUMANEVAL.member).name).exists():
            pytest.skip("HumanEval is not cached")
        with gzip.open(fetch(HUMANEVAL), "rt") as f:
            return [json.loads(line) for line in f]
    except Exception as e:  # a broken cache must not fail the corpus tests
        pytest.skip(f"HumanEval unavailable: {e}")


def source(content: str, stub_set: set[str]) -> str:
    """Which source a prompt came from: a stdlib stub, a programming or a general request."""
    if FENCE in content:
        block = content.split(FENCE, 1)[1].split("```", 1)[0]
        if block in stub_set:
            return "stubs"
    if any(text in content for text in tc.PROGRAMMING_INSTRUCTIONS):
        return "programming"
    if any(text in content for text in tc.GENERAL_INSTRUCTIONS):
        return "general"
    raise AssertionError(f"prompt from no known source: {content[:200]!r}")


def ngrams(text: str, n: int = 13) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_prompt_data_file() -> None:
    """The prompt data ships beside the module, well-formed, and the module reads it as it is."""
    file = importlib.resources.files("speckernel.tools.train").joinpath(tc.PROMPTS_FILE)
    assert file.is_file()
    data = json.loads(file.read_text(encoding="utf-8"))
    lists = ["humaneval_entry_points", "other_stub_templates", "programming_instructions", "general_instructions",
             "openings", "closings"]
    assert set(data) == {"about", "humaneval_template", *lists}
    for key in lists:
        assert isinstance(data[key], list) and data[key], key
        assert all(isinstance(v, str) for v in data[key]) and len(set(data[key])) == len(data[key]), key
    entry_points = data["humaneval_entry_points"]
    assert all(name.isidentifier() for name in entry_points) and entry_points == sorted(entry_points)
    requests = data["programming_instructions"] + data["general_instructions"]
    assert all(r and r == r.strip() for r in requests) and len(set(requests)) == len(requests)
    assert "" in data["openings"] and "" in data["closings"]  # a request also comes back with one side only
    templates = [data["humaneval_template"], *data["other_stub_templates"]]
    assert all("{stub}" in t and t.format(stub="S", name="N") for t in templates)

    assert tc.prompts() is tc.prompts()  # read once
    assert isinstance(tc.HUMANEVAL_ENTRY_POINTS, frozenset) and tc.HUMANEVAL_ENTRY_POINTS == set(entry_points)
    assert tc.HUMANEVAL_TEMPLATE == data["humaneval_template"] == tc.STUB_TEMPLATES[0]
    assert tc.STUB_TEMPLATES == tuple(templates)
    assert tc.PROGRAMMING_INSTRUCTIONS == tuple(data["programming_instructions"])
    assert tc.GENERAL_INSTRUCTIONS == tuple(data["general_instructions"])
    assert tc.INSTRUCTIONS == tuple(requests)
    assert (tc.OPENINGS, tc.CLOSINGS) == (tuple(data["openings"]), tuple(data["closings"]))

    # No hand-written text asks for a HumanEval function: none defines, calls or quotes an entry point.
    names = "|".join(map(re.escape, entry_points))
    named = re.compile(rf"(?:\bdef\s+|`)(?:{names})\b|(?<![\w.])(?:{names})\s*\(", re.I)
    for text in requests + templates + data["openings"] + data["closings"]:
        assert not named.search(text) and not tc._DEFINES_BLOCKED.search(text), text


def test_stubs_are_humaneval_shaped(stubs: list[str]) -> None:
    assert len(stubs) > 1000
    assert len(set(stubs)) == len(stubs)
    assert tc.stdlib_functions(limit=10) == stubs[:10]
    for stub in stubs:
        tree = ast.parse(stub + "    pass\n")
        assert len(tree.body) == 1
        fn = tree.body[0]
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        assert not fn.name.startswith("_")
        assert len(ast.get_docstring(fn) or "") >= tc.MIN_DOCSTRING
        assert [type(s) for s in fn.body] == [ast.Expr, ast.Pass]  # docstring only, no body


def test_package_stubs(package_stubs: list[str], stubs: list[str]) -> None:
    assert len(package_stubs) > 50
    assert len(set(package_stubs)) == len(package_stubs)
    for stub in package_stubs:
        fn = ast.parse(stub + "    pass\n").body[0]
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        assert not fn.name.startswith("_") and fn.name.lower() not in {e.lower() for e in tc.HUMANEVAL_ENTRY_POINTS}
        assert tc.MIN_DOCSTRING <= len(ast.get_docstring(fn) or "") <= tc.PACKAGE_MAX_DOCSTRING
        assert [type(s) for s in fn.body] == [ast.Expr, ast.Pass]
    # A capped package is a spread-out sample of its stubs, in file order, the same every time.
    capped = tc.package_functions("jinja2", limit=20)
    assert len(capped) == 20 and capped == tc.package_functions("jinja2", limit=20)
    positions = [package_stubs.index(s) for s in capped]
    assert positions == sorted(positions) and positions[-1] - positions[0] > len(package_stubs) // 2
    both = tc.all_stubs(["jinja2"])
    assert both[: len(stubs)] == stubs and set(both) == set(stubs) | set(package_stubs)


def test_stubs_defining_an_entry_point_are_left_out(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    example = '    Example::\n\n        def {name}(n):\n            return n\n'
    body = '    """Checks numbers against a predicate given by the caller.\n\n{example}    """\n    return a < b\n'
    module.write_text("".join(f"def check_{i}(a, b):\n" + body.format(example=example.format(name=name))
                              for i, name in enumerate(["is_prime", "Is_Prime", "is_prime_number"])))
    kept = tc._stubs_in(iter([module]))
    assert [s.split("(", 1)[0] for s in kept] == ["def check_2"]


def test_unknown_package_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="no installed package"):
        tc.package_functions("no_such_package_here")
    with pytest.raises(SystemExit) as e:
        tc.main(["--out", str(tmp_path / "c.jsonl"), "--count", "5", "--package", "no_such_package_here"])
    assert e.value.code == 2 and "no installed package" in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists()


@pytest.mark.parametrize("general,programming", [(-0.1, 0.1), (0.6, 0.5)])
def test_bad_shares_are_refused(general: float, programming: float) -> None:
    with pytest.raises(ValueError, match="shares"):
        tc.build_corpus(10, general_share=general, programming_share=programming)


def test_stubs_only_corpus_from_packages(package_stubs: list[str], stubs: list[str]) -> None:
    count = len(stubs) + 40  # every stdlib stub and some of jinja2's, each once
    contents = [m[0]["content"] for m in tc.build_corpus(count, seed=1, packages=["jinja2"], general_share=0,
                                                          programming_share=0)]
    blocks = [c.split(FENCE, 1)[1].split("```", 1)[0] for c in contents]
    assert len(set(blocks)) == count  # no stub twice while others are left
    assert set(blocks) <= set(stubs) | set(package_stubs)
    assert set(blocks) & set(package_stubs)


def test_deterministic_for_a_seed() -> None:
    assert tc.build_corpus(500, seed=3) == tc.build_corpus(500, seed=3)
    assert tc.build_corpus(500, seed=3) != tc.build_corpus(500, seed=4)


@pytest.mark.parametrize("count", [0, 1, 7, 333])
def test_count_is_honoured(count: int) -> None:
    conversations = tc.build_corpus(count)
    assert len(conversations) == count
    for messages in conversations:
        assert len(messages) == 1 and messages[0]["role"] == "user" and messages[0]["content"]


def test_negative_count_is_refused() -> None:
    with pytest.raises(ValueError):
        tc.build_corpus(-1)


def test_mix(corpus: list[list[dict[str, str]]], stubs: list[str]) -> None:
    assert len(tc.INSTRUCTIONS) >= 150
    assert len(set(tc.INSTRUCTIONS)) == len(tc.INSTRUCTIONS)
    contents = [m[0]["content"] for m in corpus]
    assert len(set(contents)) == len(contents)  # repeats always come back as a different prompt
    stub_set = set(stubs)
    sources = [source(c, stub_set) for c in contents]
    counts = {name: sources.count(name) for name in ("stubs", "programming", "general")}
    assert counts == tc.corpus_mix(len(corpus))
    assert 0.22 <= counts["general"] / len(corpus) <= 0.28
    assert 0.72 <= (counts["stubs"] + counts["programming"]) / len(corpus) <= 0.78
    stub_prompts = [c for c, s in zip(contents, sources, strict=True) if s == "stubs"]
    humaneval_phrased = sum(c.startswith(tc.HUMANEVAL_TEMPLATE.split("{", 1)[0]) for c in stub_prompts)
    assert 0.4 <= humaneval_phrased / len(stub_prompts) <= 0.6
    assert len({c.split(FENCE, 1)[0] for c in stub_prompts}) >= 4  # several phrasings


def test_small_corpus_uses_each_request_once() -> None:
    conversations = tc.build_corpus(400, seed=1)
    contents = [m[0]["content"] for m in conversations]
    requests = [c for c in contents if c in tc.INSTRUCTIONS]
    assert len(requests) == tc.corpus_mix(400)["programming"] + tc.corpus_mix(400)["general"]
    assert len(set(requests)) == len(requests)


def test_no_humaneval(humaneval: list[dict[str, str]], stubs: list[str], package_stubs: list[str],
                      corpus: list[list[dict[str, str]]]) -> None:
    entry_points = {p["entry_point"] for p in humaneval}
    assert entry_points == tc.HUMANEVAL_ENTRY_POINTS
    names = {ast.parse(s + "    pass\n").body[0].name for s in stubs}  # type: ignore[attr-defined]
    assert not {n.lower() for n in names} & {e.lower() for e in entry_points}
    texts = [m[0]["content"] for m in corpus] + stubs + package_stubs + list(tc.INSTRUCTIONS)
    # A definition of an entry point (not `>>> def f():` in some doctest example).
    defines = re.compile(rf"^\s*(?:async\s+)?def\s+(?:{'|'.join(map(re.escape, entry_points))})\s*\(", re.M)
    prompts = [p["prompt"].strip() for p in humaneval]
    bodies = [p[p.index("def "):] for p in prompts]  # without the imports above the function
    humaneval_grams = set().union(*(ngrams(p) for p in prompts))
    for text in texts:
        assert not defines.search(text), text[:200]
        assert not any(p in text for p in prompts + bodies), text[:200]
        assert not ngrams(text) & humaneval_grams, text[:200]


@pytest.mark.parametrize("name", ["corpus.jsonl", "corpus.jsonl.gz"])
def test_write_read_round_trip(tmp_path: Path, name: str) -> None:
    conversations = tc.build_corpus(50, seed=2)
    path = tmp_path / name
    tc.write_corpus(path, conversations)
    assert tc.read_corpus(path) == conversations
    assert tc.read_corpus(str(path)) == conversations
    raw = path.read_bytes()
    assert raw.startswith(b"\x1f\x8b") == name.endswith(".gz")
    text = gzip.decompress(raw).decode() if name.endswith(".gz") else raw.decode()
    lines = text.splitlines()
    assert len(lines) == 50 and all(set(json.loads(line)) == {"messages"} for line in lines)
    tc.write_corpus(path, conversations)
    assert path.read_bytes() == raw  # same corpus, same bytes (gzip without a timestamp)


def test_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c.jsonl.gz"
    assert tc.main(["--out", str(out), "--count", "40", "--seed", "5"]) == 0
    assert tc.read_corpus(out) == tc.build_corpus(40, seed=5)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "40 conversations" in lines[0] and "stdlib" in lines[0]
    assert tc.main(["--out", str(out), "--count", "40", "--package", "jinja2", "--general-share", "0"]) == 0
    assert tc.read_corpus(out) == tc.build_corpus(40, packages=["jinja2"], general_share=0)
    err = capsys.readouterr().err
    assert f"from jinja2 {tc.package_version('jinja2')}" in err and "0 general" in err
