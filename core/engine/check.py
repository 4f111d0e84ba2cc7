"""`--speculator-option KEY=VALUE` strings → the speculator's own `Options` struct.

Validation lives in the struct's types and `msgspec.Meta` constraints, so an error names the
option and what was expected; an unknown key lists every key that would be accepted.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import InvalidInputError


def parse_options(speculator: str, options_type: type[msgspec.Struct], raw: dict[str, str]) -> Any:
    known = list(options_type.__struct_fields__)
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise InvalidInputError(f"speculator {speculator!r}: unknown option(s) {', '.join(unknown)}; "
                                f"known: {', '.join(known) or '(none)'}")
    # Values arrive as strings from the command line: let msgspec parse them per field type.
    decoded: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            decoded[key] = msgspec.json.decode(value)
        except msgspec.DecodeError:
            decoded[key] = value
    try:
        return msgspec.convert(decoded, options_type, strict=False)
    except msgspec.ValidationError as e:
        raise InvalidInputError(f"speculator {speculator!r} option: {e}") from None
