"""Prefix-affinity routing, the policy without Ray: a request's prompt as a chain of hashed pieces (each piece's hash
covers everything before it), each replica's recently routed chains, and the choice: the replica holding the longest
shared prefix while the load is balanced, power-of-two choices otherwise. The pieces are the chat's messages (a next
turn repeats the earlier ones whole) or a completion prompt's characters in fixed blocks, after the model and tools,
which the prompt's cache key depends on too. Forwarded: a request as the Ray ingress hands it to a replica."""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from dataclasses import dataclass

BLOCK_CHARS = 256  # a completion prompt's piece
REMEMBERED = 65536  # pieces kept per replica, least recently routed dropped first


@dataclass(frozen=True)
class Prefix:
    """A prompt as routing sees it: `hashes[i]` covers pieces 0..i, `ends[i]` is where piece i ends (characters)."""

    hashes: tuple[int, ...]
    ends: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.ends[-1] if self.ends else 0


def prompt_prefix(path: str, body: bytes) -> Prefix:
    """The prefix of a /v1/chat/completions or /v1/completions body; empty for anything else (unreadable JSON
    included: the replica answers it with its error)."""
    try:
        request = json.loads(body) if path in ("/v1/chat/completions", "/v1/completions") else None
    except (ValueError, UnicodeDecodeError):
        request = None
    if not isinstance(request, dict):
        return Prefix((), ())
    pieces = [json.dumps([request.get("model"), request.get("tools")], sort_keys=True)]
    if path == "/v1/chat/completions":
        messages = request.get("messages")
        pieces += [json.dumps(m, sort_keys=True) for m in messages] if isinstance(messages, list) else []
    else:
        prompt = request.get("prompt")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        pieces += [text[i:i + BLOCK_CHARS] for i in range(0, len(text), BLOCK_CHARS)]
    hashes, ends, chain, end = [], [], 0, 0
    for piece in pieces:
        chain = hash((chain, piece))
        end += len(piece)
        hashes.append(chain)
        ends.append(end)
    return Prefix(tuple(hashes), tuple(ends))


class Recent:
    """The prefixes routed to one replica lately (their pieces' hashes, least recently routed dropped first)."""

    def __init__(self, capacity: int = REMEMBERED):
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def add(self, prefix: Prefix) -> None:
        for h in prefix.hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def shared(self, prefix: Prefix) -> int:
        """Characters of `prefix` this replica saw routed lately (the longest such leading run of pieces)."""
        for i in range(len(prefix.hashes) - 1, -1, -1):
            if prefix.hashes[i] in self._hashes:
                return prefix.ends[i]
        return 0


def power_of_two(replicas: list, rng: random.Random = random) -> list:
    """Two replicas at random, in random order (the caller takes the less loaded); all when there are two or less."""
    return rng.sample(replicas, min(2, len(replicas)))


def by_affinity(replicas: list, prefix: Prefix, recent: dict, load: dict, *, min_share: float = 0.1,
                imbalance: int = 4, rng: random.Random = random) -> list[list]:
    """Ranks of replicas to try in turn: those sharing the longest part of `prefix` (at least `min_share` of it)
    first, unless one's load (requests under way) exceeds another's by more than `imbalance`; then power-of-two
    choices. `recent` and `load` map each replica to its Recent and its load (missing: nothing, 0)."""
    loads = [load.get(r, 0) for r in replicas]
    if prefix.length and replicas and max(loads) - min(loads) <= imbalance:
        shared = {r: recent[r].shared(prefix) if r in recent else 0 for r in replicas}
        best = max(shared.values())
        if best and best >= min_share * prefix.length:
            first = [r for r in replicas if shared[r] == best]
            rest = [r for r in replicas if shared[r] != best]
            return [first, power_of_two(rest, rng)] if rest else [first]
    return [power_of_two(replicas, rng)]


@dataclass
class Forwarded:
    """An HTTP request as the ingress hands it to a replica: ASGI's fields, the body read, its prompt prefix."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    prefix: Prefix
    replica: str | None = None  # the replica it must go to (REPLICA_HEADER)
