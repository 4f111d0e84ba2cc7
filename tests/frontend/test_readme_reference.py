"""The README's reference tables against the code: every EngineConfig field with its default, and
every public AsyncEngine method, are listed, and nothing listed is gone, so the docs cannot drift."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import msgspec

from speckernel import AsyncEngine, EngineConfig

README = Path(__file__).parents[2] / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    assert f"### {title}\n" in text, f"the README lost its {title!r} section"
    return text.split(f"### {title}\n", 1)[1].split("\n#", 1)[0]


def table_rows(title: str) -> list[list[str]]:
    """The cells of the section's table, header and rule left out."""
    lines = [line for line in section(title).splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def shown(value: object) -> str:
    """A default as the README writes it: strings in double quotes, the rest as Python spells them."""
    return f"`{json.dumps(value)}`" if isinstance(value, str) else f"`{value!r}`"


def test_every_engine_config_field_is_listed_with_its_default() -> None:
    rows = {cells[0].strip("`"): cells for cells in table_rows("`EngineConfig` fields")}
    fields = msgspec.structs.fields(EngineConfig)
    names = [f.name for f in fields]
    missing = [n for n in names if n not in rows]
    assert not missing, f"EngineConfig fields the README does not list: {missing}"
    gone = [n for n in rows if n not in names]
    assert not gone, f"the README lists EngineConfig fields that no longer exist: {gone}"
    for f in fields:
        default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
        said = rows[f.name][1]
        assert said == shown(default), f"{f.name}: the README says {said}, the code {shown(default)}"
        assert rows[f.name][2], f"{f.name}: no description"


def public_methods() -> list[str]:
    return sorted(name for name, member in vars(AsyncEngine).items()
                  if not name.startswith("_") and inspect.isfunction(member))


def test_every_public_async_engine_method_is_listed() -> None:
    listed = " ".join(cells[0] for cells in table_rows("`AsyncEngine` methods"))
    methods = public_methods()
    assert "abort" in methods and "generate" in methods  # the scan sees the class's methods
    missing = [m for m in methods if not re.search(rf"`(?:await |async for \w+ in )?{m}\(", listed)]
    assert not missing, f"AsyncEngine methods the README does not list: {missing}"
    named = set(re.findall(r"`(?:await |async for \w+ in )?(?:engine\.)?([a-z_]+)\(", listed))
    gone = sorted(named - set(methods))
    assert not gone, f"the README lists AsyncEngine methods that no longer exist: {gone}"
    assert "`AsyncEngine(" in listed and "async with" in listed, "the constructor and `async with` are not listed"
