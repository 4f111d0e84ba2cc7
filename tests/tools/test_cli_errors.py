"""The command line fails early and clearly: every check that needs no weights runs before the
model is fetched or loaded, in one line, listing what would be accepted; the help shows every
default within 80 columns; Ctrl-C exits 130 at once."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speckernel.config import CONTEXT_CAP, DTYPE_NAMES, EngineConfig
from speckernel.engine.check import context_limit
from speckernel.tools import chat, cli
from tests.conftest import default_sigint


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


CUDA = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--prompt", "hi", "--speculator", "draft_model", "--draft-model", "no/such/draft.gguf"],
         ["no/such/draft.gguf", "no such file"]),
        (["--prompt", ""], ["prompt is empty"]),
        (["--prompt", " \n "], ["prompt is empty"]),
        (["--prompt", "hi", "--speculator", "ngram", "--num-speculative-tokens", "100"],
         ["--num-speculative-tokens", "'ngram' drafts at most 16", "got 100"]),
        (["--prompt", "hi", "--speculator", "ngram", "--num-speculative-tokens", "0"], ["got 0"]),
        (["--prompt", "hi", "--dtype", "int8"], ["--dtype", "'int8'", "float32", "bfloat16"]),
        pytest.param(["--prompt", "hi", "--platform", "cuda"], ["'cuda'", "not available"], marks=CUDA),
        (["--prompt", "hi", "--platform", "tpu"], ["unknown platform 'tpu'", "cpu"]),
        (["--prompt", "hi", "--speculator", "bogus"], ["unknown speculator 'bogus'", "ngram", "draft_model"]),
        (["--prompt", "hi", "--speculator", "ngram", "--speculator-option", "bogus=1"],
         ["unknown option(s) bogus", "known: prompt_lookup_max, prompt_lookup_min"]),
        (["--prompt", "hi", "--speculator", "ngram", "--speculator-option", "prompt_lookup_max=many"],
         ["prompt_lookup_max"]),
        (["--prompt", "hi", "--speculator-option", "num_layers=2"], ["add --speculator", "draft_model"]),
        (["--prompt", "hi", "--draft-model", "x.gguf"], ["--draft-model", "add --speculator", "draft_model, "]),
        (["--prompt", "hi", "--log-level", "bogus"], ["--log-level", "'bogus'", "debug", "warning"]),
        (["--prompt", "hi", "--max-model-len", "1"], ["--max-model-len", "in [2, ", "got 1"]),
        (["--prompt", "hi", "--model", "no/such/model.gguf"], ["unknown model 'no/such/model.gguf'"]),
        (["--prompt-file", "no/such/prompt.txt"], ["no/such/prompt.txt"]),
        (["--prompt", "hi", "--regex", "a", "--json-object"], ["--json-object and --regex", "one structured-output"]),
        ([], ["--prompt", "--prompt-file", "required"]),
    ],
)
def test_weight_free_errors_come_first_in_one_line(args: list[str], expected: list[str], empty_cache: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_cli(["generate", *args], capsys)
    assert rc == cli.EXIT_BAD_INPUT
    assert len(err) == 1, err
    for text in expected:
        assert text in err[0], err
    assert not (empty_cache / "models").exists() or not any((empty_cache / "models").iterdir())


def test_invalid_utf8_in_every_prompt_source_is_one_line(tmp_path: Path, empty_cache: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    rc, err = run_cli(["generate", "--prompt-file", str(bad)], capsys)
    assert rc == 2 and len(err) == 1 and "not valid UTF-8 (byte 0xe9 at offset 3)" in err[0]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe")))
    rc, err = run_cli(["generate", "--prompt", "-"], capsys)
    assert rc == 2 and len(err) == 1 and "stdin is not valid UTF-8" in err[0]
    # argv itself, as a shell hands it over: only a real process shows how Python decodes it
    env = {**os.environ, "SPECKERNEL_CACHE": str(empty_cache)}
    proc = subprocess.run([sys.executable, "-m", "speckernel", "generate", "--prompt", b"\xff\xfehi"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["speckernel: error: --prompt is not valid UTF-8 (byte 0xff at "
                                                "offset 0)"]


def test_prompt_comes_from_argument_file_or_stdin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "prompt.txt"
    file.write_text("naïve question\nover two lines\n")
    args = argparse.Namespace(prompt=None, prompt_file=file)
    assert cli.read_prompt(args) == "naïve question\nover two lines"  # without the file's last newline
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("from stdin ✓\n".encode())))
    assert cli.read_prompt(argparse.Namespace(prompt="-", prompt_file=None)) == "from stdin ✓"
    assert cli.read_prompt(argparse.Namespace(prompt="as given", prompt_file=None)) == "as given"


def test_over_long_prompt_fails_before_the_engine_starts(model_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine started")

    monkeypatch.setattr(cli, "AsyncEngine", no_engine)
    rc, err = run_cli(["generate", "--raw", "--prompt", "word " * 300, "--max-model-len", "256"], capsys)
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("speckernel: error: prompt has 30") and "the context holds 256" in err[0]
    # the built-in model's own context (capped as the engine caps it) is known before it loads
    rc, err = run_cli(["generate", "--prompt", "word " * 5000], capsys)
    assert rc == 2 and len(err) == 1 and f"the context holds {CONTEXT_CAP}" in err[0]


def test_cli_constants_match_the_engine() -> None:
    """The dtype names live torch-free in config (--dtype's choices and `check` read them) and
    must not drift from the platform's table; the context cap is one constant that the help,
    `check` (so the CLI's prompt check and the engine) read."""
    from speckernel.platform import DTYPES

    assert set(DTYPE_NAMES) == set(DTYPES)
    long = "random:tiny,max_position=8192"
    assert context_limit(EngineConfig(model=long), Path(long)) == CONTEXT_CAP
    assert context_limit(EngineConfig(model=long, max_model_len=6000), Path(long)) == 6000
    assert context_limit(EngineConfig(model="random:tiny"), Path("random:tiny")) == 2048
    help_text = parsers(cli.build_parser())["speckernel generate"].format_help()
    assert f"at most {CONTEXT_CAP})" in " ".join(help_text.split())


def parsers(parser: argparse.ArgumentParser, path: str = "speckernel") -> dict[str, argparse.ArgumentParser]:
    found = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= parsers(sub, f"{path} {name}")
    return found


OWN_COMMANDS = ("generate", "chat", "plugins", "bench")


def test_help_fits_80_columns_and_shows_every_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal still gets help within 80 columns
    found = {name: p for name, p in parsers(cli.build_parser()).items()
             if name == "speckernel" or name.split()[1] in OWN_COMMANDS}
    assert "speckernel bench startup" in found
    for name, parser in found.items():
        text = parser.format_help()
        wide = [line for line in text.splitlines() if len(line) > 80]
        assert not wide, (name, wide)
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or action.dest in ("help", "version"):
                continue
            assert action.help, (name, action.option_strings)
            assert "default" in parser._get_formatter()._get_help_string(action), (name, action.option_strings)


def test_version_and_help_work_through_python_dash_m() -> None:
    proc = subprocess.run([sys.executable, "-m", "speckernel", "generate", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--prompt-file PATH" in proc.stdout and "(default: 256)" in proc.stdout


def test_chat_history_drops_oldest_turns_and_keeps_the_system_prompt() -> None:
    def turn(i: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}]

    def count(messages: list[dict[str, str]]) -> int:
        return 10 * len(messages)

    system = {"role": "system", "content": "be brief"}
    messages = [system, *turn(1), *turn(2), *turn(3), {"role": "user", "content": "u4"}]
    assert chat.fit_history(messages, count, 45) == 4
    assert messages == [system, *turn(3), {"role": "user", "content": "u4"}]
    assert chat.fit_history(messages, count, 100) == 0
    # without a system prompt, whole turns go; the newest message always stays
    messages = [*turn(1), {"role": "user", "content": "u2"}]
    assert chat.fit_history(messages, count, 5) == 2 and messages == [{"role": "user", "content": "u2"}]


# --- the real model: Ctrl-C and a chat longer than the context --------------------------------


def start(*args: str, **kwargs: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "speckernel", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint,
                            **kwargs)  # type: ignore[call-overload]


def wait_for_output(proc: subprocess.Popen[bytes], marker: bytes, count: int = 1, timeout: float = 120) -> bytes:
    import selectors
    import time

    seen = b""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout
    while seen.count(marker) < count:
        assert time.monotonic() < deadline and proc.poll() is None, (seen, proc.stderr.read())  # type: ignore[union-attr]
        if sel.select(timeout=0.1):
            seen += os.read(proc.stdout.fileno(), 4096)  # type: ignore[union-attr]
    return seen


@pytest.mark.slow
@pytest.mark.timing  # exits within 10 s of Ctrl-C
def test_chat_trims_history_to_the_context_and_ctrl_c_at_its_prompt_exits_130() -> None:
    import signal
    import time

    long_line = "Please summarise: " + "the cat sat on the mat and looked at the hat. " * 6
    proc = start("chat", "--platform", "cpu", "--max-model-len", "256", "--max-tokens", "8", "--temperature", "0",
                 "--system", "Answer briefly.")
    proc.stdin.write(("\n".join([long_line] * 4) + "\n").encode())  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    out = wait_for_output(proc, b"> ", count=5)  # four replies, then idle at the prompt: no Enter comes
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert time.monotonic() - sent < 10
    assert out.count(b"> ") == 5
    err = proc.stderr.read().decode().strip().splitlines()  # type: ignore[union-attr]
    notices = [line for line in err if "oldest message(s) to fit" in line]
    assert notices and "256-token context" in notices[0], err
    assert len(err) == 1 + len(notices), err  # the banner, the notices, nothing from Ctrl-C


@pytest.mark.slow
@pytest.mark.timing  # exits within 10 s of Ctrl-C
def test_ctrl_c_while_generating_exits_130_at_once() -> None:
    import signal
    import time

    proc = start("generate", "--prompt", "Tell a very long story.", "--max-tokens", "4000", "--temperature", "0",
                 "--platform", "cpu")
    wait_for_output(proc, b" ")
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert time.monotonic() - sent < 10
    err = proc.stderr.read().decode().strip().splitlines()  # type: ignore[union-attr]
    assert len(err) <= 1, err
