"""Prefix cache for the hybrid model: a radix tree over token keys whose nodes hold the attention KV of their edge's
tokens and, at some nodes, a snapshot of every DeltaNet layer's conv + recurrent state after the node's last token.

A DeltaNet state cannot be cut back to an earlier token, so a prefix is reusable only up to the deepest node that
has a snapshot; the KV of a shared prefix is stored once, on the edges (as SGLang's MambaRadixCache). Snapshots are
taken where the engine asks (prompt chunk boundaries, the start of the last chat turn, a branch point, the end of a
prompt — with its last logits, so an identical prompt needs no prefill at all — and the end of an output). A byte
budget bounds everything held; the least recently used snapshots go first, and KV no snapshot needs goes with them.

Shapes: L tokens in a key, Lf full-attention layers, Ll DeltaNet layers; a node's KV is [Lf, 2, Hkv, n, Dh] for the
n tokens of its edge; a snapshot is conv [Ll, C, K-1] and recurrent [Ll, Hv, Dk, Dv] fp32.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from qwenrt.cache import SequenceState, kv_bytes_per_token, kv_row_size


def _stacked(states: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """The DeltaNet layers' states [1, ...] stacked to [Ll, ...]; [0, ...] for a model without DeltaNet layers."""
    return torch.cat(states) if states else torch.empty(shape)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _Node:
    __slots__ = ("key", "kv", "conv", "recurrent", "logits", "children", "parent", "end", "id")
    _ids = itertools.count()

    def __init__(self, key: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None, end: int):
        self.key, self.kv, self.parent, self.end = key, kv, parent, end  # end: tokens from the root through this edge
        self.conv = self.recurrent = self.logits = None
        self.children: dict[int, _Node] = {}
        self.id = next(self._ids)

    @property
    def has_snapshot(self) -> bool:
        return self.conv is not None

    def snapshot_bytes(self) -> int:
        return _nbytes(self.conv) + _nbytes(self.recurrent) + _nbytes(self.logits)


@dataclass
class Match:
    length: int  # tokens covered by the snapshot to restore (0: none)
    node: _Node | None
    matched: int  # tokens of the key found in the tree (KV at least), >= length: where a new branch would start

    @property
    def logits(self) -> torch.Tensor | None:
        return None if self.node is None else self.node.logits


class PrefixCache:
    def __init__(self, budget: int, config, kv_dtype: torch.dtype, store=None):
        c = config
        self.budget, self.store = budget, store  # store: a PrefixStore (snapshots on disk) or None
        self.full_layers, self.linear_layers = list(c.full_attention_layers), list(c.linear_attention_layers)
        self.kv_token_bytes = kv_bytes_per_token(c, kv_dtype)
        self.shapes = {"conv": (len(self.linear_layers), c.conv_dim, c.linear_conv_kernel_dim - 1),
                       "recurrent": (len(self.linear_layers), c.linear_num_value_heads, c.linear_key_head_dim,
                                     c.linear_value_head_dim),
                       "kv": (len(self.full_layers), 2, c.num_key_value_heads, kv_row_size(c, kv_dtype)),
                       "kv_dtype": kv_dtype,
                       "vocab": c.vocab_size}
        self.root = _Node((), None, None, 0)
        self.nbytes = 0
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # nodes with a snapshot, least recently used first
        self.queries = self.hits = self.query_tokens = self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._lru)

    # ---- lookup ----

    def match(self, key: list[int]) -> Match:
        """The deepest snapshot along `key` (in memory, else on disk): one before its end, or at its end when it
        kept the last logits."""
        found = self._match(key)
        if self.store is not None and self._load(key, found.length):
            found = self._match(key)
        self.queries += 1
        self.query_tokens += len(key)
        if found.node is not None:
            self.hits += 1
            self.hit_tokens += found.length
            self._touch(found.node)
        return found

    def _match(self, key: list[int]) -> Match:
        node, pos, best = self.root, 0, (0, None)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common(child.key, key, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
            if node.has_snapshot and (pos < len(key) or node.logits is not None):
                best = (pos, node)
        return Match(best[0], best[1], pos)

    def _load(self, key: list[int], longer_than: int) -> bool:
        """Bring the longest usable disk snapshot longer than `longer_than` into memory; True when one came."""
        for n, digest in self.store.candidates(key, longer_than):
            t = self.store.read(digest, key)
            if t is None or (n == len(key) and "logits" not in t):
                continue
            if not self._fits(t, n):
                self.store.discard(digest, "its shapes do not fit this model")
                continue
            kv = t.get("kv")
            self._insert(key[:n], lambda a, b: kv[:, :, :, a:b].clone(), t["conv"], t["recurrent"], t.get("logits"))
            return True
        return False

    def _fits(self, t: dict[str, torch.Tensor], n: int) -> bool:
        s = self.shapes
        return (tuple(t["conv"].shape) == s["conv"] and t["conv"].dtype == torch.float32
                and tuple(t["recurrent"].shape) == s["recurrent"] and t["recurrent"].dtype == torch.float32
                and (not self.full_layers or ("kv" in t and tuple(t["kv"].shape) == (*s["kv"][:3], n, s["kv"][3])
                                              and t["kv"].dtype == s["kv_dtype"]))
                and ("logits" not in t or (tuple(t["logits"].shape) == (s["vocab"],)
                                           and t["logits"].dtype == torch.float32)))

    def restore(self, match: Match, state: SequenceState) -> None:
        """Put the matched prefix into a fresh sequence cache: KV of every edge on the path, then the snapshot."""
        path, node = [], match.node
        while node is not self.root:
            path.append(node)
            node = node.parent
        state.reserve(match.length)
        for node in reversed(path):
            if node.kv is None:
                continue
            start = node.end - len(node.key)
            for j, i in enumerate(self.full_layers):
                state.keys[i][0, :, start:node.end] = node.kv[j, 0]
                state.values[i][0, :, start:node.end] = node.kv[j, 1]
        for j, i in enumerate(self.linear_layers):
            state.conv[i].copy_(match.node.conv[j:j + 1])
            state.recurrent[i].copy_(match.node.recurrent[j:j + 1])
        state.length = match.length

    # ---- insertion ----

    def insert(self, key: list[int], state: SequenceState, logits: torch.Tensor | None = None) -> None:
        """Snapshot a sequence whose cache holds exactly the tokens of `key` (and its last logits [V], if given)."""
        if not key or len(key) != state.length:
            return
        conv = _stacked([state.conv[i] for i in self.linear_layers], self.shapes["conv"])  # [Ll, C, K-1]
        recurrent = _stacked([state.recurrent[i] for i in self.linear_layers], self.shapes["recurrent"])
        logits = None if logits is None else logits.detach().reshape(-1).float().clone()
        self._insert(key, lambda a, b: self._kv_slice(state, a, b), conv, recurrent, logits)
        # a file holds the whole prefix's KV: one larger than the folder's budget would be written only to go
        if self.store is not None and len(key) * self.kv_token_bytes + _nbytes(conv) + _nbytes(recurrent) <= (
                self.store.budget):
            tensors = {"conv": conv, "recurrent": recurrent, **({} if logits is None else {"logits": logits})}
            if self.full_layers:
                tensors["kv"] = self._kv_slice(state, 0, len(key))
            self.store.write(key, tensors)

    def _insert(self, key: list[int], kv, conv: torch.Tensor, recurrent: torch.Tensor,
                logits: torch.Tensor | None) -> None:
        """Add key's path (edges' KV from kv(start, end) -> [Lf, 2, Hkv, n, Dh]) and a snapshot at its end."""
        L = len(key)
        snapshot = _nbytes(conv) + _nbytes(recurrent)
        if logits is not None and snapshot + _nbytes(logits) > self.budget:
            logits = None  # the snapshot may still fit without them
        node, pos = self.root, 0
        while pos < L:
            child = node.children.get(key[pos])
            if child is None:
                if (L - pos) * self.kv_token_bytes + snapshot > self.budget:
                    return  # would not fit even alone
                child = _Node(tuple(key[pos:L]), kv(pos, L) if self.full_layers else None, node, L)
                node.children[key[pos]] = child
                self.nbytes += _nbytes(child.kv)
                node, pos = child, L
                break
            n = _common(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        if not node.has_snapshot:
            if snapshot > self.budget:
                return
            node.conv, node.recurrent = conv.clone(), recurrent.clone()
            self.nbytes += snapshot
        if logits is not None and node.logits is None:
            node.logits = logits
            self.nbytes += _nbytes(logits)
        self._touch(node)
        self._evict(keep=node)

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut child's edge after n tokens; the new upper node has no snapshot (a state cannot be split)."""
        parent = child.parent
        start = child.end - len(child.key)
        upper = _Node(child.key[:n], None if child.kv is None else child.kv[:, :, :, :n].clone(), parent, start + n)
        if child.kv is not None:
            child.kv = child.kv[:, :, :, n:].clone()  # separate storage: each node's bytes are its own
        child.key, child.parent = child.key[n:], upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper

    # ---- memory ----

    def _kv_slice(self, state: SequenceState, start: int, end: int) -> torch.Tensor | None:
        if not self.full_layers:
            return None
        return torch.stack([torch.stack([state.keys[i][0, :, start:end], state.values[i][0, :, start:end]])
                            for i in self.full_layers])  # [Lf, 2, Hkv, n, Dh]

    def _touch(self, node: _Node) -> None:
        if node.has_snapshot:
            self._lru[node.id] = node
            self._lru.move_to_end(node.id)

    def _evict(self, keep: _Node) -> None:
        """Drop least recently used snapshots (never `keep`) until the budget holds."""
        for node in list(self._lru.values()):
            if self.nbytes <= self.budget:
                return
            if node is not keep:
                self._drop_snapshot(node)
        if self.nbytes > self.budget:
            self._drop_snapshot(keep)

    def _drop_snapshot(self, node: _Node) -> None:
        self.nbytes -= node.snapshot_bytes()
        node.conv = node.recurrent = node.logits = None
        self._lru.pop(node.id, None)
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Remove nodes that no snapshot needs any more: leaves without one, upwards."""
        while node is not self.root and not node.has_snapshot and not node.children:
            parent = node.parent
            del parent.children[node.key[0]]
            self.nbytes -= _nbytes(node.kv)
            node = parent

    def clear(self) -> None:
        for node in list(self._lru.values()):
            self._drop_snapshot(node)


def _common(edge: tuple[int, ...], key: list[int], pos: int) -> int:
    """Length of the common prefix of edge and key[pos:]."""
    n = min(len(edge), len(key) - pos)
    for i in range(n):
        if edge[i] != key[pos + i]:
            return i
    return n


def prompt_key(prompt, config) -> list[int]:
    """The prompt's token ids with every image/video placeholder replaced by a negative number derived from that
    image's (video's) pixels, so that prompts with different pictures never share a prefix past them."""
    vision = prompt.vision
    if vision is None:
        return prompt.ids
    merge = config.vision.get("spatial_merge_size", 2) if isinstance(config.vision, dict) else 2
    marks = {}
    for token, pixels, grids in ((config.image_token_id, vision.pixel_values, vision.image_grid_thw),
                                 (config.video_token_id, vision.pixel_values_videos, vision.video_grid_thw)):
        if pixels is None:
            continue
        marks[token], start = [], 0
        for t, h, w in grids.tolist():
            patches = pixels[start:start + t * h * w]
            start += t * h * w
            digest = hashlib.blake2b(patches.contiguous().numpy().tobytes() + bytes(str((t, h, w)), "ascii"),
                                     digest_size=8).digest()
            marks[token] += [-1 - (int.from_bytes(digest, "little") >> 2)] * (t * h * w // merge ** 2)
    counters = {token: iter(values) for token, values in marks.items()}
    return [next(counters[t], t) if t in counters else t for t in prompt.ids]
