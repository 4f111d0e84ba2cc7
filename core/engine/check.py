"""Everything about an EngineConfig that can be known without weights, checked in one place.

The CLI (before the model is fetched), `AsyncEngine` (before a core starts) and `EngineCore`
(before a weight is read) all call `check`, so one mistake gets one message wherever it is
made; the CLI passes a `spell` that names fields as its flags. No torch is imported here unless
a speculator is named (loading its class imports it) or a platform is (the same).

`--speculator-option KEY=VALUE` strings become the speculator's own `Options` struct in
`parse_options`: validation lives in the struct's types and `msgspec.Meta` constraints, so an
error names the option and what was expected; an unknown key lists every key that would be
accepted.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import msgspec

from .. import registry
from ..config import CONTEXT_CAP, DTYPE_NAMES, EngineConfig
from ..errors import InvalidInputError, PlatformUnavailableError, UnknownModelError, UnknownPluginError
from ..models.builtin import BUILTIN_MODELS
from ..models.checkpoint import read_config, resolve
from ..plugin import drafting_kind

if TYPE_CHECKING:  # the contract's types only: loading a speculator's class is what imports torch
    from ..plugin import Speculator, SpeculatorCapabilities

OptionsT = TypeVar("OptionsT", bound=msgspec.Struct)

Spell = Callable[[str], str]
"""How a caller names a config field in its messages (the CLI: by its flag)."""


def field_name(field: str) -> str:
    return field


class Checked(msgspec.Struct, frozen=True, kw_only=True):
    """What the check found, as its callers need it."""

    config: EngineConfig
    """The config with exact types (`EngineConfig.validate`)."""
    path: Path
    """The resolved model."""
    max_model_len: int
    """The longest context the engine can give the model before the KV cache is sized (the
    cache may lower it; `plan_kv_cache` says so)."""
    speculator: type[Speculator] | None = None
    """The speculator's class, None without one."""
    options: msgspec.Struct | None = None
    """The speculator's options, parsed into its `Options` struct (None without a speculator)."""


def check(config: EngineConfig, spell: Spell = field_name) -> Checked:
    """Field bounds, names (speculator, platform, dtype), K within the speculator's limit, its
    options, the draft model, then the model itself (a built-in is fetched) and its context.
    Raises the typed error (InvalidInputError or a subclass) naming the field as `spell` does."""
    try:
        config = config.validate()
    except InvalidInputError as e:  # "field: expected ..." names the field as the caller does
        field, _, rest = str(e).partition(": ")
        raise InvalidInputError(f"{spell(field)}: {rest}") from None
    if config.dtype is not None and config.dtype not in DTYPE_NAMES:
        raise InvalidInputError(f"unknown dtype {config.dtype!r}; available: {', '.join(DTYPE_NAMES)}")
    _check_speculator_name(config, spell)
    _check_platform(config.platform)
    _check_draft_model(config.draft_model, spell)
    cls, options = _speculator(config, spell) if config.speculator is not None else (None, None)
    path = resolve(config.model)
    if config.pipeline_parallel_size > 1:
        check_pipeline(config, read_config(path).num_layers, cls, spell)
    return Checked(config=config, path=path, max_model_len=context_limit(config, path),
                   speculator=cls, options=options)


def _check_speculator_name(config: EngineConfig, spell: Spell) -> None:
    """The speculator is installed; without one, nothing a speculator reads is given."""
    speculators = sorted(registry.discover("speculator"))
    if config.speculator is None:
        for field, given in (("draft_model", config.draft_model), ("speculator_options", config.speculator_options)):
            if given:
                raise InvalidInputError(f"{spell(field)} is read by a speculator: add {spell('speculator')} NAME "
                                        f"(available: {', '.join(speculators)})")
    elif config.speculator not in speculators:
        raise UnknownPluginError("speculator", config.speculator, speculators)


def _check_draft_model(draft: str | None, spell: Spell) -> None:
    """A draft model that is no built-in nor random must be a path that exists."""
    if draft is not None and draft not in BUILTIN_MODELS and not draft.startswith("random:") \
            and not Path(draft).expanduser().exists():
        raise UnknownModelError(f"{spell('draft_model')} {draft}: no such file or folder")


def _speculator(config: EngineConfig, spell: Spell) -> tuple[type[Speculator], msgspec.Struct]:
    """The named speculator's class (K within its limit) and its options parsed."""
    assert config.speculator is not None
    cls = registry.load("speculator", config.speculator)
    drafting_kind(cls)  # its propose and sync declare which kind of speculator it is, or it is refused here
    k, max_k = config.num_speculative_tokens, cls.capabilities.max_k
    if k > max_k:  # K >= 1 with a speculator: validate checked it
        raise InvalidInputError(f"{spell('num_speculative_tokens')}: speculator {config.speculator!r} drafts "
                                f"at most {max_k} tokens per step; got {k}")
    return cls, parse_options(config.speculator, cls.Options, dict(config.speculator_options))


def check_pipeline(config: EngineConfig, num_layers: int, cls: type[Speculator] | None,
                   spell: Spell = field_name, caps: SpeculatorCapabilities | None = None) -> None:
    """Pipeline stages: at most one per layer, a drafter that can live on the last stage (its
    placement, and its needs of the target: KV of every layer is spread over the stages), a
    rendezvous port that is free. `caps`: the speculator's capabilities for this target, where
    they are known (the core passes them; the class's own are checked otherwise)."""
    pp = config.pipeline_parallel_size
    if pp > num_layers:
        raise InvalidInputError(f"{spell('pipeline_parallel_size')}: {pp} stages for a model of {num_layers} "
                                "layers; at most one stage per layer")
    if cls is not None:
        caps = caps if caps is not None else cls.capabilities
        if caps.placement != "local_last_stage":
            raise InvalidInputError(f"speculator {config.speculator!r} has placement {caps.placement!r}; "
                                    f"{spell('pipeline_parallel_size')} {pp} serves only 'local_last_stage' "
                                    "drafters (they run on the last stage)")
        if caps.uses_target_kv:
            raise InvalidInputError(f"speculator {config.speculator!r} reads the target's KV cache, which "
                                    f"{spell('pipeline_parallel_size')} {pp} spreads over the stages")
    transports = registry.discover("transport")
    if config.pipeline_transport is not None and config.pipeline_transport not in transports:
        raise UnknownPluginError("transport", config.pipeline_transport, list(transports))
    if config.pipeline_port:
        with socket.socket() as s:
            try:
                s.bind((config.pipeline_host, config.pipeline_port))
            except OSError as e:
                raise InvalidInputError(f"{spell('pipeline_port')} {config.pipeline_port}: {e.strerror}") from None


def _check_platform(name: str | None) -> None:
    if name is None:
        return
    found = registry.discover("platform")
    if name not in found:
        raise UnknownPluginError("platform", name, list(found))
    if not registry.load("platform", name).is_available():
        raise PlatformUnavailableError(f"platform {name!r} is installed but not available here")


def context_limit(config: EngineConfig, path: Path) -> int:
    """The longest context the engine can give this model, as known before it loads: the
    model's own (a built-in's from its entry, without reading its files), capped at CONTEXT_CAP
    unless `max_model_len` asks for more."""
    builtin = BUILTIN_MODELS.get(config.model)
    known = builtin.context_length if builtin is not None and builtin.context_length else None
    if known is None:
        known = read_config(path).max_position
    return min(config.max_model_len or min(known, CONTEXT_CAP), known)


def parse_options(speculator: str, options_type: type[OptionsT], raw: dict[str, str]) -> OptionsT:
    known = list(options_type.__struct_fields__)
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise InvalidInputError(f"speculator {speculator!r}: unknown option(s) {', '.join(unknown)}; "
                                f"known: {', '.join(known) or '(none)'}")
    # Values arrive as strings from the command line: let msgspec parse them per field type.
    decoded: dict[str, object] = {}
    for key, value in raw.items():
        try:
            decoded[key] = msgspec.json.decode(value)
        except msgspec.DecodeError:
            decoded[key] = value
    try:
        return msgspec.convert(decoded, options_type, strict=False)
    except msgspec.ValidationError as e:
        raise InvalidInputError(f"speculator {speculator!r} option: {e}") from None
