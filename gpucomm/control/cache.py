"""This rank's half of the response cache (Horovod's): which names the coordinator has cached, under
which id, with which request and metadata. A request identical to the cached one travels as one bit
of its frame instead of a full description; ids come from the coordinator, so every rank agrees."""

from __future__ import annotations

from typing import Any

from .negotiation import Descriptor

Key = tuple[int, str]  # (process set id, op name)


class ResponseCache:
    def __init__(self) -> None:
        self._entries: dict[Key, tuple[int, Descriptor]] = {}  # key -> (id, descriptor)
        self._keys: dict[int, Key] = {}  # id -> key
        self._meta: dict[int, dict] = {}  # id -> the metadata of its last answer

    def item(self, key: Key, descriptor: Descriptor, payload: bytes | None) -> tuple:
        """What this rank sends for a request: a cache hit if the coordinator knows this exact request."""
        entry = self._entries.get(key)
        if entry is not None and entry[1] == descriptor:
            return ("hit", entry[0], payload)
        return ("req", key[0], key[1], descriptor, payload)

    def answer(self, key: Key, cache_id: int, meta: dict | None) -> dict:
        """Note an answer for ``key`` (``meta`` None: as last time) and return its metadata."""
        if meta is None:
            return self._meta.get(cache_id, {})
        if cache_id >= 0:
            self._meta[cache_id] = meta
            self._keys[cache_id] = key
        return meta

    def remember(self, key: Key, cache_id: int, descriptor: Descriptor) -> None:
        """This rank's request for ``key`` now stands behind ``cache_id``."""
        self._entries[key] = (cache_id, descriptor)

    def key_of(self, cache_id: int) -> Key:
        return self._keys[cache_id]

    def forget(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._keys.pop(entry[0], None)

    def __contains__(self, key: Any) -> bool:
        return key in self._entries

    def keys(self) -> list[Key]:
        return list(self._entries)


def with_bits(items: list[tuple]) -> list[tuple]:
    """A frame's items with every payload-free cache hit folded into one ``("bits", ids)`` item."""
    bits, out = 0, []
    for item in items:
        if item[0] == "hit" and item[2] is None:
            bits |= 1 << item[1]
        else:
            out.append(item)
    if bits:
        out.append(("bits", bits))
    return out


__all__ = ["ResponseCache", "with_bits"]
