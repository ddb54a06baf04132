"""Where a forward pass spends its time, stage by stage, for the profiling page.

A ``StageClock`` rides on the ``Step`` (``step.clock``); the blocks call ``lap(stage)``
at their boundaries, and the time since the previous lap is that stage's. One clock read
and one list add per boundary (no context managers, no dicts): cheap enough to leave on.

The clock reads the host's wall clock. On a backend that queues work and runs it when the
host needs a result (MLX, Vulkan: ``Backend.deferred``), a stage's time is the time its
host code took plus whatever queued work it waited for: the routers' choices and the
logits are where the device's work shows up there."""

from __future__ import annotations

from time import perf_counter_ns

# the stages of a forward pass, in drawing order
EMBED, ATTENTION, PREFETCH, ROUTERS, ROUTED_EXPERTS, EXPERT_READS, SHARED_EXPERTS, DENSE_MLP, LM_HEAD, OTHER = range(10)
STAGES = ("embed", "attention", "prefetch", "routers", "routed_experts", "expert_reads", "shared_experts", "dense_mlp",
          "lm_head", "other")


class StageClock:
    """Nanoseconds per stage since it was made (or ``reset``)."""

    __slots__ = ("ns", "last")

    def __init__(self) -> None:
        self.ns = [0] * len(STAGES)
        self.last = perf_counter_ns()

    def start(self) -> None:
        """A step begins now: time before it is nobody's."""
        self.last = perf_counter_ns()

    def lap(self, stage: int) -> None:
        """The time since the previous lap was ``stage``'s."""
        now = perf_counter_ns()
        self.ns[stage] += now - self.last
        self.last = now

    def move(self, ns: int, source: int, target: int) -> None:
        """``ns`` of ``source``'s time belonged to ``target`` (the part of the routed experts'
        time spent waiting for their reads)."""
        self.ns[source] -= ns
        self.ns[target] += ns

    def seconds(self) -> dict[str, float]:
        return {name: ns / 1e9 for name, ns in zip(STAGES, self.ns)}
