"""The expert store's read threads: the most urgent read first.

A first-in-first-out pool queues a layer's misses behind the reads already predicted for
the layers after it, so the computation that waits on a miss waits for speculative reads
too. Here every read carries a priority (lower first: a layer's demand reads before any
prefetch, prefetches for nearer layers before farther ones), and a queued read can be
hurried when its layer turns out to need it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future


class ReadPool:
    """``workers`` threads running submitted reads in priority order (then in order of
    submission). Futures are ``concurrent.futures.Future``: a read cancelled before it
    starts never runs."""

    def __init__(self, workers: int, name: str = "colibri-io"):
        if workers < 1:
            raise ValueError(f"a read pool needs at least one worker, got {workers}")
        self._queue: list = []  # heap of (priority, seq, future, fn, args)
        self._seq = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, priority: tuple, fn, *args) -> Future:
        future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the expert read pool is closed")
            heapq.heappush(self._queue, (priority, next(self._seq), future, fn, args))
            self._wake.notify()
        return future

    def hurry(self, future: Future, priority: tuple) -> None:
        """Give a queued read ``priority`` if that is more urgent (nothing once it started)."""
        with self._wake:
            for i, (old, seq, queued, fn, args) in enumerate(self._queue):
                if queued is future:
                    if priority < old:
                        self._queue[i] = (priority, seq, queued, fn, args)
                        heapq.heapify(self._queue)
                    return

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                _, _, future, fn, args = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                result = fn(*args)
            except BaseException as exc:  # the waiting caller gets it, as from ThreadPoolExecutor
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Cancel the queued reads, finish the running ones, stop the threads."""
        with self._wake:
            self._closed = True
            for _, _, future, _, _ in self._queue:
                future.cancel()
            self._queue.clear()
            self._wake.notify_all()
        for thread in self._threads:
            thread.join()
