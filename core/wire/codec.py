"""msgpack framing with out-of-band numpy buffers.

`encode` returns a list of frames: the msgpack payload first, then one frame per large array,
which pyzmq sends without copying. Small arrays stay inline: a frame costs more than a copy.

`decode` is total: whatever the frames hold, it returns a message or raises msgspec.DecodeError /
ValidationError (never RecursionError, MemoryError from a forged shape, or anything else), so
a receiving loop needs one except clause to survive any frame.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

INLINE_MAX_BYTES = 256


class Encoder:
    def __init__(self) -> None:
        self._aux: list[memoryview] = []
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._hook)

    def encode(self, obj: Any) -> list[bytes | memoryview]:
        self._aux = []
        payload = self._enc.encode(obj)
        frames: list[bytes | memoryview] = [payload, *self._aux]
        self._aux = []
        return frames

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj).reshape(obj.shape)  # ascontiguousarray makes 0-d 1-d
            if arr.nbytes <= INLINE_MAX_BYTES:
                return (arr.dtype.str, arr.shape, arr.tobytes())
            self._aux.append(arr.reshape(-1).data.cast("B"))
            return (arr.dtype.str, arr.shape, len(self._aux))
        raise NotImplementedError(f"cannot encode {type(obj).__name__}")


class Decoder:
    def __init__(self, type_: Any) -> None:
        self._aux: list[Any] = []
        self._dec = msgspec.msgpack.Decoder(type_, dec_hook=self._hook)

    def decode(self, frames: list[Any]) -> Any:
        """frames: bytes, memoryviews or zmq.Frame objects; raises msgspec.DecodeError when malformed."""
        if not frames:
            raise msgspec.DecodeError("no frames")
        self._aux = [getattr(f, "buffer", f) for f in frames[1:]]
        try:
            return self._dec.decode(getattr(frames[0], "buffer", frames[0]))
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise
        except Exception as e:  # RecursionError on deep nesting, and anything else a forged frame finds
            raise msgspec.DecodeError(f"undecodable frame: {type(e).__name__}: {e}") from e
        finally:
            self._aux = []

    def _hook(self, type_: Any, obj: Any) -> Any:
        if type_ is np.ndarray:
            try:
                dtype, shape, data = obj
                dt = np.dtype(dtype)
                if dt.hasobject:
                    raise TypeError(f"object dtype {dtype!r}")
                if isinstance(data, int) and not 1 <= data <= len(self._aux):
                    raise IndexError(f"no frame {data}")
                buf = self._aux[data - 1] if isinstance(data, int) else data
                return np.frombuffer(buf, dtype=dt).reshape(shape)
            except Exception as e:
                raise msgspec.ValidationError(f"malformed array: {e}") from e
        raise NotImplementedError(f"cannot decode {type_}")
