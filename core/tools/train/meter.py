"""Training tokens/s and how busy the GPU is, per log interval: whether the trainer keeps the
device fed, read at the log points (where the host syncs anyway), never inside a step.

GPU utilisation comes from NVML when it answers (`torch.cuda.utilization`, which needs pynvml):
the share of time a kernel ran, as the driver samples it, whoever ran it (a GPU shared with
other processes reads busier). Without NVML, CUDA events around each step give the share of
the interval's device time spent inside steps; gaps between the kernels of one step count as
busy there, so it is an upper bound. The log says which (`gpu_source`).
"""

from __future__ import annotations

import threading
import time

import torch

SAMPLE_S = 0.5
"""Seconds between NVML readings (the driver's own sample period is 1/6 s to 1 s)."""


class NvmlSampler:
    """Reads `torch.cuda.utilization` every SAMPLE_S in a thread; `read` is the mean since the last read."""

    source = "nvml"

    def __init__(self, device: torch.device) -> None:
        torch.cuda.utilization(device)  # raises here when NVML (pynvml) is not there
        self.device = device
        self.samples: list[float] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="speckernel-gpu-util", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            try:
                value = float(torch.cuda.utilization(self.device))
            except Exception:  # NVML gone away mid-run (driver reset): the log shows no figure
                return
            with self.lock:
                self.samples.append(value)

    def begin(self) -> None:
        return None

    def end(self) -> None:
        return None

    def read(self) -> float | None:
        with self.lock:
            samples, self.samples = self.samples, []
        return sum(samples) / len(samples) if samples else None

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class EventClock:
    """CUDA events around each step; `read` (after the host synced) is the percentage of the
    device time from the interval's first step to its last spent inside steps."""

    source = "events"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def begin(self) -> None:
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self.device))
        self.steps.append((start, torch.cuda.Event(enable_timing=True)))

    def end(self) -> None:
        self.steps[-1][1].record(torch.cuda.current_stream(self.device))

    def read(self) -> float | None:
        steps, self.steps = self.steps, []
        if not steps:
            return None
        steps[-1][1].synchronize()  # done already when the caller read the figures: no wait
        busy = sum(start.elapsed_time(end) for start, end in steps)
        span = steps[0][0].elapsed_time(steps[-1][1])
        return 100.0 * min(1.0, busy / span) if span > 0 else None

    def close(self) -> None:
        self.steps = []


class Meter:
    """Counts training tokens (positions whose label counts) and times the steps; `read` gives
    the interval's tokens/s and GPU utilisation (%, CUDA only), `total` the whole run's."""

    def __init__(self, device: torch.device) -> None:
        self.gpu: NvmlSampler | EventClock | None = None
        if device.type == "cuda":
            try:
                self.gpu = NvmlSampler(device)
            except Exception:  # no pynvml, or NVML does not answer for this GPU
                self.gpu = EventClock(device)
        self.tokens = 0
        self.since = time.monotonic()
        self.all_tokens, self.all_seconds = 0, 0.0
        self.util_seconds = self.util_weighted = 0.0

    def begin(self) -> None:
        if self.gpu is not None:
            self.gpu.begin()

    def end(self, tokens: int) -> None:
        self.tokens += tokens
        if self.gpu is not None:
            self.gpu.end()

    def read(self) -> dict[str, float]:
        """{"tokens_per_s", "gpu_util"}: since the last read (gpu_util only when measured)."""
        now = time.monotonic()
        seconds = max(now - self.since, 1e-9)
        figures = {"tokens_per_s": self.tokens / seconds}
        util = self.gpu.read() if self.gpu is not None else None
        if util is not None:
            figures["gpu_util"] = util
            self.util_seconds += seconds
            self.util_weighted += util * seconds
        self.all_tokens += self.tokens
        self.all_seconds += seconds
        self.tokens, self.since = 0, now
        return figures

    def total(self) -> dict[str, float | str]:
        """The run's training tokens/s and time-weighted GPU utilisation, with its source."""
        out: dict[str, float | str] = {"tokens_per_s": self.all_tokens / max(self.all_seconds, 1e-9)}
        if self.gpu is not None and self.util_seconds:
            out["gpu_util"] = self.util_weighted / self.util_seconds
            out["gpu_source"] = self.gpu.source
        return out

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
