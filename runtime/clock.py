"""Timings that are true on every device: when the device *finished* work, not when it was issued.

On CUDA a kernel launch returns at once, so a host clock read around it measures the launch. A
``DeviceClock`` marks points in the stream of work issued to one device and says when the device
reached them:

* CPU (and any device whose work runs as it is issued): a mark is the host clock, read with
  ``time.perf_counter``;
* CUDA: a mark is a timing ``torch.cuda.Event`` recorded on the current stream; reading it waits
  for that event only (no device-wide synchronise between marks, so overlapped streams stay
  overlapped). The clock synchronises the device once, when it is made, to tie its events to the
  host clock (``anchor``).

Every mark reads as wall-clock seconds (``time.time()``'s scale, ``perf_counter``'s resolution), so
intervals from several processes line up on one timeline. Use::

    clock = DeviceClock(device)
    start = clock.mark()
    ...                                    # work issued to the device
    ms = clock.elapsed_ms(start, clock.mark())
"""

from __future__ import annotations

import time
from typing import Union

import torch

# Wall-clock seconds at perf_counter() == 0, fixed once per process: every mark of the process is on
# one scale (an NTP step during the run moves time.time(), not the marks).
_WALL_AT_ZERO = time.time() - time.perf_counter()

Mark = Union[float, "torch.cuda.Event"]


def wall_seconds() -> float:
    """The host's wall clock now, in seconds since the epoch, at ``perf_counter`` resolution."""
    return _WALL_AT_ZERO + time.perf_counter()


class DeviceClock:
    """Marks in the work issued to ``device`` and the wall-clock second the device reached each."""

    def __init__(self, device: Union[torch.device, str]) -> None:
        self.device = torch.device(device)
        self.events = self.device.type == "cuda"
        if self.events:
            torch.cuda.synchronize(self.device)
            self._anchor = self._record()
            self._anchor.synchronize()
            self._anchor_wall = wall_seconds()

    def _record(self) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self) -> Mark:
        """This point of the device's work (CUDA: an event on the current stream; else the host clock)."""
        return self._record() if self.events else wall_seconds()

    def seconds(self, mark: Mark) -> float:
        """Wall-clock seconds at which the device reached ``mark`` (CUDA: waits for its event)."""
        if isinstance(mark, float):
            return mark
        mark.synchronize()
        return self._anchor_wall + self._anchor.elapsed_time(mark) / 1e3

    def elapsed_ms(self, start: Mark, end: Mark) -> float:
        """Milliseconds the device took from ``start`` to ``end`` (CUDA: waits for ``end``)."""
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            end.synchronize()
            return start.elapsed_time(end)
        return (self.seconds(end) - self.seconds(start)) * 1e3
