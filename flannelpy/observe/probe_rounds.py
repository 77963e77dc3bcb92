"""One probe round to one peer, on the wire: two ICMP echoes sent through a Transport,
and what their replies (or silence, or the kernel's refusal) say as a RoundOutcome.

A round is a small echo (ping's default size) and, when the overlay MTU is larger,
one of exactly the overlay MTU that must not be fragmented (DF set over IPv4,
IPV6_DONTFRAG over IPv6). A local EMSGSIZE for the big echo means our own route's
MTU is below the overlay MTU. :class:`flannelpy.dataplane.icmp.IcmpTransport` is the
raw-socket Transport and needs root; the unit tests use a fake one.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from typing import Protocol

from flannelpy.dataplane.icmp import Reply
from flannelpy.observe.probe_verdict import BigOutcome, RoundOutcome

SMALL_PROBE_BYTES = 84  # total IP packet of ping's default 56-byte payload
SMALL_PROBE_BYTES6 = 104  # the same over IPv6 (40-byte header)


class Transport(Protocol):
    """Sends ICMP echoes with DF set and hands back what answered them."""

    def send(
        self, source: IPv4Address | IPv6Address, target: IPv4Address | IPv6Address, size: int
    ) -> int:
        """Send one echo request of ``size`` bytes (whole IP packet), never fragmented,
        over the target's family (``source`` is of the same); return its ticket.

        Raises OSError when the kernel refuses it (EMSGSIZE: larger than the route MTU).
        """
        ...

    def take_replies(self) -> list[Reply]:
        """Replies that arrived since the last call."""
        ...

    def cancel(self, ticket: int) -> None:
        """Forget a ticket (timed out), so a late reply is ignored."""
        ...


@dataclass
class Echo:
    size: int
    ticket: int | None = None  # outstanding while set
    done: bool = False
    rtt: float | None = None
    error: str | None = None
    refused: bool = False  # locally (EMSGSIZE) or by an ICMP "fragmentation needed"


@dataclass
class Round:
    deadline: float
    small: Echo
    big: Echo | None

    def echoes(self) -> list[Echo]:
        return [self.small] if self.big is None else [self.small, self.big]


def start_round(
    transport: Transport,
    tickets: dict[int, Echo],
    source: IPv4Address | IPv6Address,
    target: IPv4Address | IPv6Address,
    small_size: int,
    big_size: int | None,
    deadline: float,
) -> Round:
    """Send the small echo and the big one (None: none), entering each sent echo in
    ``tickets``; an echo the kernel refuses is done at once."""
    rnd = Round(deadline, Echo(small_size), None)
    if big_size is not None:
        rnd.big = Echo(big_size)
    for echo in rnd.echoes():
        try:
            echo.ticket = transport.send(source, target, echo.size)
        except OSError as e:
            echo.done = True
            echo.refused = e.errno == errno.EMSGSIZE
            echo.error = _send_error_text(e, source, target, echo.size)
            continue
        tickets[echo.ticket] = echo
    return rnd


def round_outcome(
    rnd: Round, target: IPv4Address | IPv6Address, timeout_seconds: float
) -> RoundOutcome:
    """What a finished round says; an echo without reply or error timed out."""
    small_ok = rnd.small.rtt is not None
    errors = []
    if not small_ok:
        errors.append(
            rnd.small.error or _timeout_text(rnd.small.size, target, False, timeout_seconds)
        )
    big: BigOutcome = "not-sent"
    if rnd.big is not None:
        if rnd.big.rtt is not None:
            big = "answered"
        else:
            big = "refused" if rnd.big.refused else "lost"
            errors.append(
                rnd.big.error or _timeout_text(rnd.big.size, target, True, timeout_seconds)
            )
    return RoundOutcome(small_ok, rnd.small.rtt, big, "; ".join(errors) or None)


_TIMEOUT_TEXTS: dict[tuple[int, bool, int, int, float], str] = {}
MAX_TIMEOUT_TEXTS = 16384  # two per peer and family


def _timeout_text(
    size: int, target: IPv4Address | IPv6Address, df: bool, timeout_seconds: float
) -> str:
    """Kept per echo kind and target: a silent peer's rounds say the same every time. The
    key holds the address's integer (an address object's own hash formats it in hex)."""
    key = (size, df, target.version, int(target), timeout_seconds)
    text = _TIMEOUT_TEXTS.get(key)
    if text is None:
        if len(_TIMEOUT_TEXTS) >= MAX_TIMEOUT_TEXTS:
            _TIMEOUT_TEXTS.clear()
        text = _TIMEOUT_TEXTS[key] = _format_timeout(size, target, df, timeout_seconds)
    return text


def _format_timeout(
    size: int, target: IPv4Address | IPv6Address, df: bool, timeout_seconds: float
) -> str:
    kind = f"{size}-byte DF echo (the overlay MTU)" if df else f"{size}-byte echo"
    return f"no reply from {target} to a {kind} within {timeout_seconds:g} s"


def _send_error_text(
    e: OSError, source: IPv4Address | IPv6Address, target: IPv4Address | IPv6Address, size: int
) -> str:
    if e.errno == errno.EMSGSIZE:
        kind = "DF" if target.version == 4 else "unfragmentable"
        return (
            f"message too long: this node refuses to send a {size}-byte {kind} packet to "
            f"{target}, so its route MTU is below the overlay MTU"
        )
    return f"cannot send an echo from {source} to {target}: {e.strerror or e}"
