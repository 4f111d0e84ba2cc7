"""A structured-output constraint that does not compile (--regex, --json-schema, --grammar) fails
like the rest of the command line's bad input: one line on stderr that names the flag (and its
file), exit code 2, before the model is fetched; the compiler's own message spans lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from speckernel.errors import InvalidSamplingParamsError
from speckernel.tools import cli
from speckernel.tools.engine_args import structured_error


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache without the model, and a pip that cannot find it: a check that ran after the
    fetch would fail with "could not download" instead of its own message."""
    monkeypatch.setenv("SPECKERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    return tmp_path / "cache"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    ("regex", "expected"),
    [
        ("((", ["--regex: invalid regular expression '((': unclosed group (at character 2)"]),
        ("a{2,1}", ["--regex: invalid regular expression 'a{2,1}'", "the start must be <= the end"]),
        ("(?<=a)b", ["'(?<=a)b'", "look-around", "not supported", "(at character 1)"]),
    ],
)
def test_an_invalid_regex_is_one_line_naming_the_flag(regex: str, expected: list[str], empty_cache: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_cli(["generate", "--prompt", "hi", "--regex", regex], capsys)
    assert rc == cli.EXIT_BAD_INPUT
    assert len(err) == 1, err
    assert err[0].startswith("speckernel: error: --regex: "), err
    for text in expected:
        assert text in err[0], err
    assert not (empty_cache / "models").exists()


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("bad.json", "{not json", ["--json-schema {path}: not valid JSON (", "line 1 column 2"]),
        ("bad-type.json", '{"type": "bogus"}', ["--json-schema {path}: invalid JSON schema: Invalid type: bogus"]),
        ("list.json", "[1, 2]", ["--json-schema {path}: invalid JSON schema: schema must be an object"]),
        ("unknown.lark", "start: foo", ['--grammar {path}: invalid grammar: line 1, column 8: unknown name: "foo"']),
        ("terminal.lark", "start: /((/",
         ['--grammar {path}: invalid grammar: line 1, column 8: invalid regex "((": unclosed group']),
        ("lexer.lark", "start: x\nx ::: !!", ["--grammar {path}: invalid grammar: line 2, column ", "lexer error"]),
        ("no-start.lark", 'x: "a"', ["--grammar {path}: invalid grammar: no start rule found"]),
    ],
)
def test_an_invalid_schema_or_grammar_file_is_one_line_naming_the_flag_and_file(
        name: str, text: str, expected: list[str], tmp_path: Path, empty_cache: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / name
    path.write_text(text)
    flag = "--json-schema" if name.endswith(".json") else "--grammar"
    rc, err = run_cli(["generate", "--prompt", "hi", flag, str(path)], capsys)
    assert rc == cli.EXIT_BAD_INPUT
    assert len(err) == 1, err
    for part in expected:
        assert part.format(path=path) in err[0], err
    assert "structured." not in err[0]
    assert not (empty_cache / "models").exists()


def test_the_command_itself_prints_one_line(empty_cache: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "speckernel", "generate", "--prompt", "hi", "--regex", "(("],
                          capture_output=True, text=True, timeout=120, env={**os.environ})
    assert done.returncode == cli.EXIT_BAD_INPUT
    assert done.stderr.splitlines() == [
        "speckernel: error: --regex: invalid regular expression '((': unclosed group (at character 2)"]
    assert done.stdout == ""


@pytest.mark.slow
def test_a_grammar_the_core_refuses_ends_in_one_line(tmp_path: Path) -> None:
    """A token range past the vocabulary passes the check without a tokenizer; the core refuses it
    once the model is loaded, and the command still says so in one line naming the flag."""
    grammar = tmp_path / "tokens.lark"
    grammar.write_text("start: <[99999999]>")
    done = subprocess.run([sys.executable, "-m", "speckernel", "generate", "--prompt", "hi", "--platform", "cpu",
                           "--max-model-len", "256", "--max-tokens", "4", "--quiet", "--grammar", str(grammar)],
                          capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == cli.EXIT_BAD_INPUT, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("speckernel: error:")]
    assert errors == [f"speckernel: error: --grammar {grammar}: invalid grammar: line 1, column 8: "
                      "Token range end too large: 99999999"], done.stderr
    assert not [line for line in done.stderr.splitlines() if line.startswith(("   1 | ", "    "))], done.stderr


def test_a_refusal_by_the_core_is_one_line_too() -> None:
    """After the model loads, the core compiles the grammar with the tokenizer and may still refuse
    it; its message comes back as the same multi-line compiler text."""
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--grammar", "g.lark"])
    refused = InvalidSamplingParamsError('structured.grammar: at 3(5): unknown name: "item"\n'
                                         "   3 | x: item\n           ^")
    assert str(structured_error(args, refused)) == \
        '--grammar g.lark: invalid grammar: line 3, column 5: unknown name: "item"'
    regex = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--regex", "[a-z]"])
    refused = InvalidSamplingParamsError("structured.regex: at 1(8): no token can start the output\n"
                                         "   1 | start: /[a-z]/\n              ^")
    assert str(structured_error(regex, refused)) == "--regex: invalid regular expression: no token can start the output"
    other = InvalidSamplingParamsError("top_p: expected a float in (0, 1],\n got 2")
    assert str(structured_error(args, other)) == "top_p: expected a float in (0, 1], got 2"


def test_a_valid_constraint_still_passes() -> None:
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--regex", "[a-z]+"])
    params = cli.params_from(args)
    assert params.structured is not None and params.structured.regex == "[a-z]+"
    assert params.structured_output
