"""The engine's trio loop, kept running in a thread of its own for the engine's life.

The step graph's lanes are trio tasks (``runtime/exec/executor.py``); between the user's calls
they go on running there (the backward's first gathers and reads while the user computes the
loss). The user's thread reaches the loop with :meth:`Background.call` (an async function) or
:meth:`Background.call_sync`, each run on the loop and its result or exception handed back.
"""
from __future__ import annotations

import threading

import trio

from zdsl.errors import ZdslApiError

JOIN_S = 10.0       # close(): how long the loop may take to wind up once cancelled


class Background:
    """A trio loop in a daemon thread: :attr:`nursery` holds the tasks the engine starts."""

    def __init__(self, name: str = "zdsl-engine"):
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ZdslApiError(f"the engine's trio loop did not start: {self._error}") from self._error

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:    # noqa: BLE001 - reported to the thread that waits for it
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def call(self, afn, *args):
        """``await afn(*args)`` on the loop; its result, or its exception raised here."""
        return trio.from_thread.run(afn, *args, trio_token=self.token)

    def call_sync(self, fn, *args):
        """``fn(*args)`` on the loop's thread; its result, or its exception raised here."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def close(self) -> None:
        """Cancel what still runs on the loop and end its thread (idempotent)."""
        if self.alive and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
            except trio.RunFinishedError:
                pass
            self.thread.join(JOIN_S)
