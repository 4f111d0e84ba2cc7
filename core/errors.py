"""Typed errors of the public API.

Bad input raises a subclass of `InvalidInputError` (the CLI turns it into exit code 2);
`EngineDeadError` means the engine core is gone and nothing more will be served;
`EngineRequestError` that one request failed while it ran, and the engine goes on.
"""

from __future__ import annotations


class SpeckernelError(Exception):
    """Base of every error speckernel raises on purpose."""


class InvalidInputError(SpeckernelError, ValueError):
    """The caller asked for something the engine cannot serve; other requests go on."""


class InvalidSamplingParamsError(InvalidInputError):
    pass


class PromptTooLongError(InvalidInputError):
    pass


class UnknownModelError(InvalidInputError):
    pass


class UnknownPluginError(InvalidInputError):
    """Names the plugin group, the unknown name and every name that would be accepted."""

    def __init__(self, group: str, name: str, known: list[str]) -> None:
        self.group, self.name, self.known = group, name, known
        super().__init__(
            f"unknown {group} {name!r}; available: {', '.join(sorted(known)) or '(none)'}"
        )


class PlatformUnavailableError(InvalidInputError):
    pass


class ModelFetchError(SpeckernelError):
    """The embedded default model could not be downloaded or failed its checksum."""


class EngineOverloadedError(SpeckernelError):
    """The engine (or the server in front of it) has no room for this request now; retry later."""


class EngineRequestError(SpeckernelError):
    """The engine failed this request while running it (an error on the device or in the model,
    named in the message); the engine and its other requests go on."""


class EngineDeadError(SpeckernelError):
    """The engine core process died or shut down; pending and new requests fail with this."""


def rebuild(type_name: str, message: str) -> SpeckernelError | None:
    """The typed error a peer process reported by class name, or None for a foreign type."""
    cls = globals().get(type_name)
    if not (isinstance(cls, type) and issubclass(cls, SpeckernelError)):
        return None
    if cls is UnknownPluginError:  # its message is already complete; keep it a bad-input error
        return InvalidInputError(message)
    return cls(message)
