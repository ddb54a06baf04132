"""Router look-ahead prefetch.

While layer L computes, predict the experts of the next MoE layer by applying that
layer's own norm and router to the hidden state leaving layer L's attention, and start
reading the predicted experts on the store's I/O pool. The prediction changes only what
is read early; the routing itself is computed as always when the layer runs.

Whether reading ahead pays is measured, step by step (``MeasuredGate``): on a disk busy
with demand reads, or with few cores, a wasted read can cost more than a used one saves.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

import numpy as np


QUIET_STEPS = 4  # steps without reads ahead that ``Prefetcher.cannot_pay`` goes by
# how much longer than the disk's idle time the unused reads must take before reading ahead
# is ruled out: the rate measured over the busy time includes spells with a single read in
# flight, which the I/O pool's other threads could have used
BOUND_MARGIN = 2.0


class MeasuredGate:
    """Whether a decode step reads predicted experts ahead, decided by timing steps both ways.

    Reading ahead trades disk time and a share of the cores for the waits it saves; which
    wins depends on the disk, the cores and the routing, and only the clock knows. The gate
    runs blocks of ``block`` one-row decode steps, alternately with and without reads
    ahead, until it has timed ``samples`` steps each way, keeps the faster way (by median;
    reads ahead on a tie) for the next ``hold`` one-row steps, then measures again. Each
    time a measurement confirms the way it had chosen, the hold doubles (up to
    ``longest_hold``), and it is ``hold`` again after a change: a trial runs one block the
    slower way, so on a steady machine trials grow rare, and a change of phase is still
    followed. Steps of several rows (prompts, batches) run the way last chosen and are
    not timed. Either way the tokens are the same.

    A trial's block reading ahead comes first: the first trial's first block runs on the
    coldest cache, which biases it toward not reading ahead, the side that cannot cost.
    While the gate holds "without", ``cannot_pay`` (when given: a bound computed from the
    steps just run without reads ahead) can spare a trial its block reading ahead: the
    way without is then chosen as if measured faster. On a disk that the demand reads
    keep busy, a trial's reads ahead cost more than the block they are measured in.

    Blocks, not single steps, because reading ahead also costs later steps: a wrong
    prediction evicts an expert that a later step then reads again, and reads still queued
    delay the next step's. Alternating single steps charged those costs to the steps
    without reads ahead, so the gate kept reading ahead where it lost. The first
    ``settle`` steps of a block are not timed (they pay for the block before), and the
    rest of the cost of a block's reads falls on its own steps.
    """

    def __init__(self, samples: int = 4, hold: int = 72, block: int = 6, settle: int = 2, clock=time.perf_counter,
                 longest_hold: int = 576, cannot_pay=None):
        if not 0 <= settle < block:
            raise ValueError(f"settle ({settle}) must be below block ({block})")
        if longest_hold < hold:
            raise ValueError(f"longest_hold ({longest_hold}) must be at least hold ({hold})")
        self.samples, self.hold, self.block, self.settle, self.clock = samples, hold, block, settle, clock
        self.longest_hold = longest_hold
        self.cannot_pay = cannot_pay  # () -> whether reading ahead cannot pay, by a bound; None: measure always
        self.spared = 0  # trials decided by ``cannot_pay`` without a block reading ahead
        self.chosen = True  # reads ahead until measured otherwise
        self._measured = False  # whether ``chosen`` comes from a measurement yet
        self._next_hold = hold
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self._hold_left = 0  # one-row steps left before the next trial
        self._way, self._block_step = True, block  # the current trial block's way, and its steps so far
        self._timing: tuple[bool, float] | None = None  # (way, start) of the step being timed

    def begin(self, rows: int) -> bool:
        """A step of ``rows`` rows starts: whether it reads ahead."""
        self._timing = None
        if rows != 1:
            return self.chosen
        if self._hold_left > 0:
            self._hold_left -= 1
            return self.chosen
        if self._block_step >= self.block:  # a new block: the way with fewer samples, reading ahead first
            self._way, self._block_step = len(self._times[True]) <= len(self._times[False]), 0
            if (self._way and self._measured and not self.chosen and self.cannot_pay is not None
                    and self.cannot_pay()):
                self.spared += 1
                self._decide(False)
                return self.begin(rows)
        self._block_step += 1
        if self._block_step > self.settle:
            self._timing = (self._way, self.clock())
        return self._way

    def end(self) -> None:
        """The step begun last has finished its layers."""
        if self._timing is None:
            return
        ahead, started = self._timing
        self._timing = None
        self._times[ahead].append(self.clock() - started)
        if min(len(t) for t in self._times.values()) >= self.samples:
            self._decide(statistics.median(self._times[True]) <= statistics.median(self._times[False]))

    def _decide(self, chosen: bool) -> None:
        """A trial chose: hold ``chosen`` (longer each time a trial confirms the way held)."""
        confirmed = self._measured and chosen == self.chosen
        self._next_hold = min(2 * self._next_hold, self.longest_hold) if confirmed else self.hold
        self.chosen, self._measured = chosen, True
        self._times = {True: [], False: []}
        self._hold_left, self._block_step = self._next_hold, self.block


def ranked(indices: np.ndarray, weights) -> list[int]:
    """The experts a router chose for a step's rows, surest first: by the routing weight
    they got summed over the rows (with one row, the router's own order), then by how
    many rows chose them, then lower ids. A window smaller than the step's experts
    (``--prefetch-window``) then reads the likeliest."""
    flat = np.asarray(indices).ravel()
    votes = np.bincount(flat)
    mass = np.zeros(votes.size)
    w = None if weights is None else np.asarray(weights)
    if w is not None and w.shape == np.shape(indices):
        np.add.at(mass, flat, np.abs(w.ravel().astype(np.float64)))
    order = np.lexsort((np.arange(votes.size), -votes, -mass))
    return [int(e) for e in order if votes[e] > 0]


@dataclass
class _Next:
    norm: object
    router: object
    moe_index: int
    slots: int
    behind: int | None  # the MoE index of the predicting layer itself, if it is one


class Prefetcher:
    def __init__(self, lm, store, slots: int, gate: MeasuredGate | None = None):
        """``slots``: at most this many experts are read ahead per layer (each borrows a
        slot of its layer's cache while staged: ``ExpertStore.prefetch``); ``gate`` decides
        per step whether to (default: a ``MeasuredGate``)."""
        self.store = store
        self.gate = gate if gate is not None else MeasuredGate(cannot_pay=self.cannot_pay)
        self._ahead = True  # whether this step reads ahead (predictions are scored either way)
        # the last one-row steps run without reading ahead: (ns, disk busy ns, bytes read,
        # unused predicted bytes), and the same counters as the step now running began
        self._quiet: deque[tuple[int, int, int, int]] = deque(maxlen=QUIET_STEPS)
        self._began: tuple[int, int, int, int] | None = None
        # a disk tier plugin need not time its reads: then the bound decides nothing
        self._disk_timed = hasattr(store.disk, "busy_ns") and hasattr(store.disk, "bytes_read")
        self._next: dict[int, _Next] = {}
        moe_layers = [(i, layer) for i, layer in enumerate(lm.layers) if getattr(layer, "mlp", None) is not None
                      and hasattr(layer.mlp, "router") and hasattr(layer.mlp, "experts")]
        for (i, _), (j, nxt) in zip(moe_layers, moe_layers[1:]):
            here = lm.layers[i].mlp.experts.decl.moe_index
            for k in range(i, j):  # every layer from this MoE layer up to the next one predicts it
                # a MoE layer's own misses are read before what it predicts (ExpertStore.prefetch)
                self._next[id(lm.layers[k])] = _Next(nxt.mlp_norm, nxt.mlp.router, nxt.mlp.experts.decl.moe_index,
                                                     slots, here if k == i else None)
        # a first MoE layer routed by token id (DeepSeek-V4's hash layers) is known exactly
        # from the ids, before any layer runs; later ones are predicted exactly as above
        self._first = None
        if moe_layers and hasattr(moe_layers[0][1].mlp.router, "experts_for"):
            first = moe_layers[0][1].mlp
            self._first = (first.router, first.experts.decl.moe_index)

    def after_embedding(self, step) -> None:
        """A step starts: ask the gate whether it reads ahead, and start reading the first
        MoE layer's experts when the token ids alone decide them."""
        rows = len(step.positions)
        ahead = self.gate.begin(rows)
        self._began = self._counters() if rows == 1 and not ahead and self._disk_timed else None
        self._ahead = ahead
        if not ahead:
            self.store.stats.prefetch_steps_off += 1
        if self._first is None or step.ids is None:
            return
        router, moe_index = self._first
        self.store.prefetch(moe_index, [int(e) for e in np.unique(router.experts_for(step.ids, step.ops))],
                            issue=self._ahead, exact=True)

    def after_layers(self, step) -> None:
        """The step's layers are done (the gate times the step up to here)."""
        self.gate.end()
        if self._began is not None:
            self._quiet.append(tuple(b - a for a, b in zip(self._began, self._counters())))
            self._began = None

    def _counters(self) -> tuple[int, int, int, int]:
        disk = self.store.disk
        return time.perf_counter_ns(), disk.busy_ns(), disk.bytes_read, self.store.stats.predicted_reads_unused_bytes

    def cannot_pay(self) -> bool:
        """Whether the last steps run without reading ahead show that it cannot pay: the
        predicted reads their layers did not use would have kept the disk busy (at the
        rate it read in those steps) for more than ``BOUND_MARGIN`` times as long as it
        stood idle in them. Reads ahead can only save waits by using the disk's idle time,
        and every unused one takes some; so this spares the measured gate a trial that
        could only lose. Steps without reads to go by (all hits, or a tier that does not
        time its reads) decide nothing: the gate measures. A disk whose idle time is not
        lost (a throttle that lets a burst make up for it) looks less busy than it is:
        the bound then rules out less, and the gate measures."""
        if len(self._quiet) < QUIET_STEPS:
            return False
        ns, busy, nbytes, unused = (sum(c) for c in zip(*self._quiet))
        if busy <= 0 or nbytes <= 0:
            return False
        return unused * busy / nbytes > BOUND_MARGIN * (ns - busy)

    def after_attention(self, layer, h, step) -> None:
        nxt = self._next.get(id(layer))
        if nxt is None:
            return
        indices, weights = nxt.router(nxt.norm(h, step), step)
        real = len(self.store.layouts[nxt.moe_index])  # beyond: zero-computation experts, never read
        chosen = [e for e in ranked(indices, weights) if e < real][: nxt.slots]
        self.store.prefetch(nxt.moe_index, chosen, behind=nxt.behind, issue=self._ahead,
                            several=len(step.positions) > 1)
