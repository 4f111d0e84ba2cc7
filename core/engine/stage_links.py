"""The links of a pipeline, made one way whatever carries them: the transport is configuration's
(`EngineConfig.pipeline_transport`) or the first installed of the platform's
`preferred_transports`, loaded by name and opened from a `TransportContext`, so a vendor's
transport package carries a pipeline without a change here.

Links, in the one order every stage opens them (so a transport whose `open` waits for its peer
never deadlocks): stage i to stage i + 1 (the residual stream), then, with more than two stages,
the first to the last (token windows; at two stages the one link carries both). Each link's
lower rank binds, at `pipeline_host` on a port it takes, and announces the address through the
stages' rendezvous store; the other end reads it there. The last stage's token frames go to the
engine core on one more link, which the core binds and names in the stage bootstrap.
"""

from __future__ import annotations

import socket
from typing import Any

import msgspec

from .. import registry
from ..config import EngineConfig
from ..errors import InvalidInputError
from ..platform import PlatformCapabilities
from ..transport import Transport, TransportContext

RENDEZVOUS_TIMEOUT_S = 600.0
"""How long a stage waits at the rendezvous for its peers' addresses (they load weights and
capture graphs first); the engine core's startup timeout ends a pipeline sooner."""


def free_port(host: str) -> int:
    """A port free on `host` now (the caller binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def transport_name(config: EngineConfig, caps: PlatformCapabilities) -> str:
    """Configuration's transport, else the platform's first preferred one that is installed."""
    installed = registry.discover("transport")
    if config.pipeline_transport is not None:
        cls = registry.load("transport", config.pipeline_transport)  # an unknown name lists the installed ones
        if not cls.capabilities.cross_process:
            raise InvalidInputError(f"pipeline_transport {config.pipeline_transport!r} links ends of one process "
                                    "only; stages are processes")
        return config.pipeline_transport
    for name in caps.preferred_transports:
        if name in installed:
            return name
    raise InvalidInputError(f"none of the transports platform {caps.device_type!r} prefers "
                            f"({', '.join(caps.preferred_transports)}) is installed; installed: "
                            f"{', '.join(sorted(installed)) or '(none)'}; name one with pipeline_transport")


def open_link(name: str, ctx: TransportContext) -> Transport:
    return registry.load("transport", name).open(ctx)


def stage_links(world: int) -> list[tuple[int, int]]:
    """(binding rank, connecting rank) of every link between stages, in the order they open."""
    return [(i, i + 1) for i in range(world - 1)] + ([(0, world - 1)] if world > 2 else [])


def open_stage_links(name: str, store: Any, base: TransportContext, host: str) -> dict[int, Transport]:
    """This stage's ends of its links, by peer rank. `store`: the rendezvous (a torch.distributed
    Store: `set`, and a `get` that waits for the key); `base`: the context every end shares
    (rank, world, device, backend, frame sizes), its peer, address and bind filled in here."""
    ends: dict[int, Transport] = {}
    for low, high in stage_links(base.world):
        if base.rank not in (low, high):
            continue
        key = f"speckernel/link/{low}-{high}"
        bind = base.rank == low
        if bind:
            address = f"tcp://{host}:{free_port(host)}"
            store.set(key, address)
        else:
            address = store.get(key).decode()
        ctx = msgspec.structs.replace(base, peer=high if bind else low, address=address, bind=bind)
        ends[ctx.peer] = open_link(name, ctx)
    return ends
