"""The second process of the state machine's sharing rules (tests/_stateful_worker.py): an
importer at the other end of a socket pair, driven by the owner's worker.

Requests: ``start(fd, device)``, ``recv(expect_error)``, ``refresh(expect_error)``,
``read()`` (the committed bytes of each imported segment), ``write(segment, offset, data)``,
``close()``, ``reset()`` (close, collect, and check that its fault-injecting driver holds
nothing). Replies as the owner's worker's: ``("ok", detail)``, ``("raised", type, message)``
or ``("violation", text)``.

Arrays taken from the import are dropped within the request that took them: an array held
across a refresh that unmaps its chunk faults (the invariant "an import's arrays keep their
mappings" is being fixed); lift that by keeping exports here across requests.
"""

from __future__ import annotations

import gc
import socket
import traceback

import numpy as np

DOCUMENTED = (ValueError, TypeError, IndexError, BufferError, RuntimeError)

_state: dict = {}


def _new_driver():
    from jaxbuf.drivers import get_vmm_driver
    from jaxbuf.testing import FaultInjectingDriver

    return FaultInjectingDriver(get_vmm_driver(_state["device"]))


def _receive(op: str, expect_error: bool):
    from jaxbuf.sharing import recv_buffer

    sock = _state["sock"]
    try:
        if op == "recv":
            if _state.get("imported") is not None:
                _state["imported"].close()
            _state["imported"] = None
            _state["imported"] = recv_buffer(sock, driver=_state["driver"], timeout=30)
        else:
            _state["imported"].refresh(sock, timeout=30)
    except DOCUMENTED as error:
        if not expect_error:
            raise
        if not str(error):
            return ("violation", f"{type(error).__name__} with an empty message")
        return ("raised", type(error).__name__, str(error))
    if expect_error:
        return ("violation", f"{op} accepted a hostile layout")
    return ("ok", _sizes())


def _sizes():
    imported = _state.get("imported")
    if imported is None or imported.closed:
        return None
    return [imported.segment_view(i).nbytes for i in range(imported.num_segments)]


def handle(op: str, kwargs: dict):
    try:
        if op == "start":
            _state.update(sock=socket.socket(fileno=kwargs["fd"]), device=kwargs["device"])
            import jaxbuf  # noqa: F401

            _state["driver"] = _new_driver()
            return ("ok", "started")
        if op in ("recv", "refresh"):
            return _receive(op, kwargs.get("expect_error", False))
        imported = _state.get("imported")
        if op == "read":
            if imported is None or imported.closed:
                return ("ok", None)
            out = []
            for i in range(imported.num_segments):
                view = imported.segment_view(i)
                out.append(bytes(view.to_numpy()) if view.nbytes else b"")
            return ("ok", out)
        if op == "write":
            segment, offset, data = kwargs["segment"], kwargs["offset"], kwargs["data"]
            view = imported.segment_view(segment)
            view.to_numpy()[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
            return ("ok", "written")
        if op == "close":
            if imported is not None:
                imported.close()
            return ("ok", "closed")
        if op == "reset":
            if imported is not None:
                imported.close()
            _state["imported"] = imported = None
            gc.collect()
            driver = _state["driver"]
            found = [f"{len(driver.live_handles)} live handle(s)"] if driver.live_handles else []
            found += [f"{len(driver.mapped)} mapped chunk(s)"] if driver.mapped else []
            found += [f"{len(driver.reservations)} reservation(s)"] if driver.reservations else []
            found += driver.problems()
            _state["driver"] = _new_driver()
            if found:
                return ("violation", "the importer's driver holds " + ", ".join(found))
            return ("ok", "clean")
        raise AssertionError(op)
    except DOCUMENTED as error:
        return ("raised", type(error).__name__, str(error))
    except BaseException as error:  # noqa: BLE001 - reported to the owner as a failure
        return ("violation", "undocumented " + "".join(traceback.format_exception(error)))


if __name__ == "__main__":
    from _child import serve

    serve(handle)
