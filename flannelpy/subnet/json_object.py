"""A JSON object from another machine, kept small: thousands of leases each carry one.

A lease's ``BackendData`` is a JSON object of two or three members (``VNI``,
``VtepMAC``; ``PublicKey`` for WireGuard). As a dict each costs 184 bytes; here the
names are one tuple shared by every object with the same ones, and the values a tuple
of their own: about 100. Read-only, as a lease is.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

# Names tuples seen, each kept once; bounded, since the names come from other machines.
_NAMES: dict[tuple[str, ...], tuple[str, ...]] = {}
_NAMES_KEPT = 64


class JsonObject(Mapping[str, Any]):
    """A read-only mapping of a decoded JSON object's members, in their order."""

    __slots__ = ("_names", "_values")

    def __init__(self, members: Mapping[str, Any]) -> None:
        names = tuple(sys.intern(name) for name in members)
        shared = _NAMES.get(names)
        if shared is None:
            shared = names
            if len(_NAMES) < _NAMES_KEPT:
                _NAMES[names] = names
        self._names = shared
        self._values = tuple(members.values())

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values[self._names.index(name)]
        except ValueError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __eq__(self, other: object) -> bool:
        if isinstance(other, JsonObject) and other._names is self._names:
            return other._values == self._values  # the usual case, in C
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(zip(self._names, self._values, strict=True)) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]  # as a dict's

    def __repr__(self) -> str:
        return repr(dict(zip(self._names, self._values, strict=True)))
