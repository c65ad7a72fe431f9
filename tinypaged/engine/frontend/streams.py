"""The requests' output streams of the engine client (client.py), whichever transport carries them: one slot per
request holding its newest output, read by the request's async iterator. A reader that goes away before its
request finishes, by closing, cancelling or dropping the iterator, makes the client abort the request."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, Callable

from tinypaged.outputs import RequestOutput

__all__ = ["Streams"]

_Item = RequestOutput | BaseException


class _Latest:
    """A request's stream slot: the newest cumulative output (or the error that ended it) not yet read.

    Outputs are cumulative, so a newer one replaces an unread older one: a client slower than the engine
    gets one chunk carrying several tokens (as vLLM merges a lagging stream's outputs), and a stalled client
    holds one snapshot, not one per step.
    """

    def __init__(self) -> None:
        self._item: _Item | None = None
        self._ready = asyncio.Event()

    def put(self, item: _Item) -> None:
        """Offer the newest output or an error; an unread finished output or error is never replaced."""
        if self._item is None or (isinstance(self._item, RequestOutput) and not self._item.finished):
            self._item = item
            self._ready.set()

    async def get(self) -> _Item:
        """Wait for, and take, the newest item."""
        await self._ready.wait()
        self._ready.clear()
        item, self._item = self._item, None
        assert item is not None
        return item


class Streams:
    """The open streams by request id. Every method runs on the event loop (`open` in a running loop), except
    the garbage collector's callback, which hands its work to the loop."""

    def __init__(self, abort: Callable[[str], None]) -> None:
        self._abort = abort  # queue the abort of a request whose reader went away
        self._slots: dict[str, _Latest] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    def ids(self) -> list[str]:
        """The ids of the requests whose streams are open."""
        return list(self._slots)

    def open(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """The stream of a request just queued: its outputs as `dispatch` delivers them, the last finished, or
        the error `fail` gives it."""
        slot = _Latest()
        self._slots[request_id] = slot
        stream = self._stream(request_id, slot)
        # An async generator dropped before it ran never runs its `finally`: abort it when it is collected.
        weakref.finalize(stream, self._abandoned, asyncio.get_running_loop(), request_id, slot)
        return stream

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its request's stream (a finished one closes the slot)."""
        slots = self._slots
        for out in outputs:
            slot = slots.get(out.request_id)
            if slot is None:
                continue  # its reader is gone; the abort is queued
            slot.put(out)
            if out.finished:
                del slots[out.request_id]

    def fail(self, request_ids: list[str], error: BaseException) -> None:
        """End these requests' streams with `error`."""
        for rid in request_ids:
            slot = self._slots.pop(rid, None)
            if slot is not None:
                slot.put(error)

    async def _stream(self, request_id: str, slot: _Latest) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while True:
                item = await slot.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._end(request_id, slot)

    def _end(self, request_id: str, slot: _Latest) -> None:
        """A reader gone before its request finished: forget its slot, abort the request."""
        if self._slots.get(request_id) is slot:
            del self._slots[request_id]
            self._abort(request_id)

    def _abandoned(self, loop: asyncio.AbstractEventLoop, request_id: str, slot: _Latest) -> None:
        # Called by the garbage collector, possibly on another thread: hand the work to the loop.
        if not loop.is_closed() and self._slots.get(request_id) is slot:
            loop.call_soon_threadsafe(self._end, request_id, slot)
