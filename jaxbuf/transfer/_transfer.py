"""A posted request, whichever transport moves it: :class:`Transfer` and its error."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from jaxbuf._checks import as_seconds

if TYPE_CHECKING:
    from jaxbuf.transfer._transport import Request

__all__ = ["DEFAULT_TIMEOUT", "Transfer", "TransferError"]

DEFAULT_TIMEOUT = 60.0
"""Seconds :meth:`Transfer.wait` waits by default."""


class TransferError(RuntimeError):
    """The transport reported a transfer failed; the message names the blocks."""


class Transfer(abc.ABC):
    """One posted request of block ids (every tensor and segment it names).

    :meth:`wait` returns when it is done, raising :class:`TransferError` if the transport
    reports a failure and ``TimeoutError`` after ``timeout`` (it stays in flight then);
    :meth:`settle` waits without raising. Until it finishes it is tracked by its
    ``trackers`` (the registrations of the memory it moves, and its peer), so memory under
    it is not released and its peer is not replaced. What the transport holds for it is
    released once, when it finishes.
    """

    def __init__(self, request: Request, trackers: list[Any]) -> None:
        self.request = request
        self._trackers = trackers
        self.error: str | None = None
        self.finished = False

    def _track(self) -> None:
        for tracker in self._trackers:
            tracker.track(self)

    @property
    def what(self) -> str:
        """The request in words: ``WRITE of blocks [0, 1] <-> peer:blocks [4, 5]``."""
        return self.request.words()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.what})"

    def _finish(self, error: str | None) -> None:
        """Record the outcome, release what the transport holds, then forget the transfer:
        an interrupted release is retried by the next settle."""
        self._release()
        self.finished, self.error = True, error
        for tracker in self._trackers:
            tracker.untrack(self)

    @abc.abstractmethod
    def _release(self) -> None:
        """Give back what the transport holds for the finished transfer (once)."""

    @abc.abstractmethod
    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the transfer to finish (done or failed);
        whether it has. Never raises a failure of the transfer (:meth:`wait` does)."""

    def wait(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Wait for the transfer; TimeoutError (it stays in flight) or TransferError."""
        timeout = as_seconds(timeout, "timeout")
        if not self.settle(timeout):
            raise TimeoutError(f"{self.what} did not finish within {timeout} s")
        if self.error is not None:
            raise TransferError(f"{self.what} failed: {self.error}")

    @property
    def done(self) -> bool:
        """Whether the transfer has finished, checked now (without waiting)."""
        return self.settle(0.0)
