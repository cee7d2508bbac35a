"""The scheduler decides, the runner runs: each step it admits waiting sequences as capacity allows, picks the decode
batch (every running sequence past its prompt) and spends what is left of the step's token budget on prompt chunks
(cut at the points where the engine snapshots a prefix).

Memory is reserved per sequence when it is admitted: its DeltaNet state plus KV for as many tokens as it may hold
(prompt + max_tokens, at most its context limit), so a running sequence never runs out; a request whose reservation
alone exceeds the budget is refused when it arrives (see `Engine.add_request`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qwenrt.engine.request import Sequence, Status


@dataclass
class SchedulerConfig:
    max_running: int  # sequences decoded together at most
    max_batched_tokens: int  # tokens per step at most: one per decoding sequence, the rest for prompt chunks
    memory_budget: int  # bytes of cache (KV + DeltaNet state) all running sequences may reserve together


@dataclass
class Schedule:
    decode: list[Sequence] = field(default_factory=list)  # one new token each
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, prompt tokens this step)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, config: SchedulerConfig, reservation):
        self.config = config
        self.reservation = reservation  # Sequence -> bytes it reserves while running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0  # bytes reserved by the running sequences

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences to running, first come first served, while the running count and the memory
        reservations allow; returns them (the engine gives each its cache)."""
        c, admitted = self.config, []
        while self.waiting and len(self.running) < c.max_running:
            need = self.reservation(self.waiting[0])
            if self.reserved + need > c.memory_budget:
                break
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            self.reserved += need
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def schedule(self, tokens: int) -> Schedule:
        """Every decoding sequence one token; prompt chunks, shortest remaining prompt first, within the rest of
        `tokens` (this step's budget), each request's chunk limit and up to its next snapshot point."""
        plan = Schedule(decode=[s for s in self.running if not s.prefilling])
        budget = min(tokens, self.config.max_batched_tokens) - len(plan.decode)
        # short prompts first: a short request's first token does not wait for a long prompt's prefill
        for seq in sorted((s for s in self.running if s.prefilling), key=lambda s: s.prompt_len - s.computed):
            if budget <= 0:
                break
            n = min(seq.next_boundary() - seq.computed, budget, seq.request.prefill_chunk or budget)
            plan.prefill.append((seq, n))
            budget -= n
        return plan

    def finish(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out (waiting or running); its reservation is free at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.reserved -= self.reservation(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
