"""Entry-point registry: the only way the kernel reaches a concrete plugin."""

from __future__ import annotations

import sys
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Literal, overload

import msgspec

from .errors import PlatformUnavailableError, UnknownPluginError

if TYPE_CHECKING:  # the contracts import torch; the CLI lists plugins without it
    from .platform import Platform
    from .plugin import Speculator
    from .transport import Transport

Kind = Literal["speculator", "platform", "transport"]

GROUPS: dict[Kind, str] = {
    "speculator": "speckernel.speculators",
    "platform": "speckernel.platforms",
    "transport": "speckernel.transports",
}


@cache
def discover(kind: Kind) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUPS[kind])}


@overload
def load(kind: Literal["speculator"], name: str) -> type[Speculator]: ...
@overload
def load(kind: Literal["platform"], name: str) -> type[Platform]: ...
@overload
def load(kind: Literal["transport"], name: str) -> type[Transport]: ...


def load(kind: Kind, name: str) -> type[Speculator] | type[Platform] | type[Transport]:
    """The class registered as `name` in kind's entry-point group. It is trusted to be that
    kind's protocol (`speckernel.conformance` checks a speculator)."""
    found = discover(kind)
    if name not in found:
        raise UnknownPluginError(kind, name, list(found))
    cls: type[Speculator] | type[Platform] | type[Transport] = found[name].load()
    return cls


def pick_platform(name: str | None = None) -> Platform:
    """Instantiates the named platform, or the highest-priority available one."""
    if name is not None:
        cls = load("platform", name)
        if not cls.is_available():
            raise PlatformUnavailableError(f"platform {name!r} is installed but not available here")
        return cls()
    candidates: list[type[Platform]] = [ep.load() for ep in discover("platform").values()]
    available = [c for c in candidates if c.is_available()]
    if not available:
        raise PlatformUnavailableError("no available platform found")
    return max(available, key=lambda c: c.capabilities.priority)()


def description(cls: type) -> str:
    """A plugin's first sentence: its class's own docstring, else its module's."""
    doc = cls.__dict__.get("__doc__") or getattr(sys.modules.get(cls.__module__), "__doc__", None) or ""
    text = " ".join(doc.split())
    end = text.find(". ")
    return text[: end + 1] if end >= 0 else text


def describe() -> dict[str, dict[str, Any]]:
    """Every discovered plugin with its declared capabilities, for `speckernel plugins`."""
    out: dict[str, dict[str, Any]] = {}
    for kind, group in GROUPS.items():
        section: dict[str, Any] = {}
        for name, ep in sorted(discover(kind).items()):
            try:
                cls = ep.load()
                entry = {"entry_point": ep.value, "description": description(cls),
                         **msgspec.to_builtins(cls.capabilities)}
                options = getattr(cls, "Options", None)
                if kind == "speculator":  # in_step or after_step, as its propose and sync say
                    # the speculator contract, read only where speculators are listed
                    from .plugin import drafting_kind

                    entry["drafting"] = drafting_kind(cls)
                if options is not None:  # a speculator's options with their defaults
                    entry["options"] = {f.name: None if f.default is msgspec.NODEFAULT else f.default
                                        for f in msgspec.structs.fields(options)}
                if hasattr(cls, "is_available"):
                    entry["available"] = bool(cls.is_available())
            except Exception as e:  # a broken third-party plugin must not hide the others
                entry = {"entry_point": ep.value, "error": f"{type(e).__name__}: {e}"}
            section[name] = entry
        out[group.rsplit(".", 1)[1]] = section
    return out
