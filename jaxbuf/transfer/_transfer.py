"""A posted block transfer, whichever transport moves it (NIXL, or the same-host copy)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxbuf._checks import as_seconds
from jaxbuf.transfer._blocks import describe

if TYPE_CHECKING:
    from jaxbuf.transfer._nixl import Agent
    from jaxbuf.transfer._registration import Registration

__all__ = ["DEFAULT_TIMEOUT", "Transfer", "TransferError", "request_words"]

DEFAULT_TIMEOUT = 60.0
"""Seconds :meth:`Transfer.wait` waits by default."""
# Poll without sleeping this long: small transfers finish in microseconds, and a sleep costs
# a scheduler round trip (tens of microseconds, far more on a loaded machine).
_SPIN_SECONDS = 2e-3


def request_words(request: tuple[str, np.ndarray, str, np.ndarray]) -> str:
    """``(operation, local blocks, peer name, remote blocks)`` in words, for messages."""
    operation, local, peer, remote = request
    return f"{operation} of {describe(local)} <-> {peer}:{describe(remote)}"


class TransferError(RuntimeError):
    """The transport reported a transfer failed; the message names the blocks."""


class Transfer:
    """One posted block transfer. :meth:`wait` returns when it is done (raising
    :class:`TransferError` if NIXL reports a failure, ``TimeoutError`` after ``timeout``);
    the NIXL handle is released once it has finished."""

    def __init__(
        self,
        agent: Agent,
        handle: Any,
        request: tuple[str, np.ndarray, str, np.ndarray],
        registration: Registration,
        state: str,
    ) -> None:
        self._agent, self._handle = agent, handle
        # (operation, local blocks, peer name, remote blocks): described only when needed.
        self._request = request
        self._registration = registration
        self.error: str | None = None
        self.finished = False
        if state == "PROC":
            registration.track(self)
        else:  # done (or failed) in the post itself, as small transfers often are
            self.finished = True
            self.error = None if state == "DONE" else f"NIXL reported {state}"
            self._handle = None
            agent.release_transfer(handle)

    @property
    def what(self) -> str:
        """The request in words: ``WRITE of blocks [0, 1] <-> peer:blocks [4, 5]``."""
        return request_words(self._request)

    def __repr__(self) -> str:
        return f"Transfer({self.what})"

    def _finish(self, error: str | None) -> None:
        """Record the outcome, release what the transport holds for the transfer, then
        forget it: an interrupted release is retried by the next settle."""
        self._release()
        self.finished, self.error = True, error
        self._registration.untrack(self)

    def _release(self) -> None:
        """Give back the transport's handle of the finished transfer (once)."""
        if self._handle is not None:
            self._agent.release_transfer(self._handle)
            self._handle = None

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the transfer to finish (done or failed);
        whether it has. Never raises a failure of the transfer (:meth:`wait` does)."""
        if self.finished:
            return True
        agent, handle = self._agent, self._handle
        start = time.monotonic()
        while True:
            state = agent.state(handle)
            if state != "PROC":
                self._finish(None if state == "DONE" else f"NIXL reported {state}")
                return True
            waited = time.monotonic() - start
            if waited >= timeout:
                return False
            if waited > _SPIN_SECONDS:
                time.sleep(min(1e-4, timeout - waited))

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
