"""The largest frame each ZeroMQ socket takes from its peer (`zmq.MAXMSGSIZE`), and why.

libzmq reads a frame's length before its body: a frame over the receiving socket's limit
disconnects the peer there, before any of it is buffered, so a peer (or a forged length) can make
the receiver hold at most this much per frame, not 256 MiB or 2**63 bytes. The limit is per
frame: the codec (`codec`) sends a message's msgpack head as one frame and each array over 256
bytes as a frame of its own, so every bound below is that of the largest single frame the code
sends on that link, with room to spare.

- Drafter RPC, to `speckernel serve-drafter` (a peer holding an admitted key, maybe on another
  host): the largest frame is one declared target layer's hidden states of one step, [T, H] with
  T the step's query tokens and H the target's hidden size, at most 4 bytes a value (float32;
  bfloat16 travels as int16 bits). The head (rows, sampling) and the tokens (8 bytes each) stay
  far below it; `drafter_request_limit` bounds T at the server's `--max-step-tokens`.
- Drafter replies, to the engine's `remote` speculator: `Drafted` is [rows, K] int64 and
  `Described` a capabilities dict: REPLY_FRAME_BYTES holds 2 Mi draft tokens.
- Frontend <-> engine core, and the core <-> its pipeline stages (peers the engine spawned,
  CURVE-keyed or on loopback): `engine_frame_limit`, from the config. The largest frames are a
  prompt (int64 ids, below max_model_len: the frontend refuses a longer one before it is sent), a
  pipeline step's StepFrame (its token ids, block tables and grammar bitmasks) and a step's
  outputs (each token with up to 20 logprobs); ENGINE_FRAME_FLOOR covers them at the default
  sizes many times over, and the sizes that grow with the config are added on top.
"""

from __future__ import annotations

import math

from ..config import CONTEXT_CAP, EngineConfig

MIB = 2**20
HIDDEN_VALUE_BYTES = 4
"""float32, the widest hidden-state carrier (`drafter.HIDDEN_CARRIERS`)."""
DRAFTER_FRAME_FLOOR = 16 * MIB
"""Whatever the target, a drafter request frame may be this large (heads of many rows)."""
DEFAULT_STEP_TOKENS = 8192
"""The query tokens of one engine step a drafter server takes by default: the most it plans its
attention for (`engine.drafter`), and 4x the engine's default max_num_batched_tokens."""
REPLY_FRAME_BYTES = 16 * MIB
"""A drafter reply frame: [rows, K] int64 drafts of 2 Mi tokens, or a long error message."""
ENGINE_FRAME_FLOOR = 64 * MIB
"""Every engine link takes frames this large: a request head (sampling parameters, a grammar; an
HTTP body is 8 MiB by default), a step's outputs, a stage's report."""
INT_BYTES = 9
"""The most bytes an integer takes in msgpack (an int64 array element takes 8)."""
ROW_TOKEN_BYTES = 40 * 1024
"""Per scheduled token position (rows x (K+1)): a grammar bitmask row (a vocabulary of 2**18
tokens takes 32 KiB) and an output token with 20 logprobs (< 1 KiB)."""


def drafter_request_limit(hidden_size: int, step_tokens: int = DEFAULT_STEP_TOKENS) -> int:
    """Bytes of the largest frame a drafter server takes: one layer's [step_tokens, hidden_size]."""
    return max(DRAFTER_FRAME_FLOOR, HIDDEN_VALUE_BYTES * hidden_size * step_tokens)


def engine_frame_limit(config: EngineConfig) -> int:
    """Bytes of the largest frame the engine's own links take, twice the most the config lets
    the code send (at the defaults, ENGINE_FRAME_FLOOR)."""
    context = config.max_model_len or CONTEXT_CAP
    rows = config.max_num_seqs
    ints = context + config.max_num_batched_tokens + rows * math.ceil(context / config.block_size)
    need = INT_BYTES * ints + ROW_TOKEN_BYTES * rows * (config.num_speculative_tokens + 1)
    return max(ENGINE_FRAME_FLOOR, 2 * need)
