"""What a peer's probe rounds mean: the outcome of one round, and the verdict over the
last ``window`` rounds that status.json and the metrics report.

Over the last ``window`` rounds of a peer (``window`` cycles once the cluster
outgrows the prober's budget):

- loss: small echoes not answered / small echoes sent;
- reachable: some echo answered in the last ``down_after`` rounds (one lost
  packet is loss, not an outage);
- mtu_ok: True as soon as a full-size DF echo is answered; False on a local
  refusal, a "fragmentation needed" answer, or ``mtu_strikes`` rounds in a row
  (skipping rounds where the small echo was lost too) where the small echo was
  answered and the big one was not. Requiring several strikes keeps random loss
  from passing for an MTU problem; None until either is seen.

Pure: no clock, no sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What the prober knows about one peer, after its latest completed round."""

    reachable: bool
    rtt_seconds: float | None  # latest answered small echo; None when unreachable
    loss_ratio: float  # 0.0 .. 1.0 over the window
    mtu_ok: bool | None  # None: not verified either way yet
    last_error: str | None  # the latest round's problem; None when it went fine
    probes: int  # rounds completed since the peer was added
    target: IPv4Address | IPv6Address | None = None
    label: str = ""

    @property
    def family(self) -> str:
        """ "ipv6" for the IPv6 side of a dual-stack peer, else "ipv4"."""
        return "ipv6" if self.target is not None and self.target.version == 6 else "ipv4"

    def as_status(self) -> dict[str, Any]:
        """The ``status.json`` form: {reachable, rtt_ms, loss, mtu_ok, error, probes}."""
        rtt_ms = None if self.rtt_seconds is None else round(self.rtt_seconds * 1000, 3)
        return {
            "reachable": self.reachable,
            "rtt_ms": rtt_ms,
            "loss": round(self.loss_ratio, 4),
            "mtu_ok": self.mtu_ok,
            "error": self.last_error,
            "probes": self.probes,
        }


BigOutcome = Literal["not-sent", "answered", "lost", "refused"]


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """One completed round to one peer."""

    small_ok: bool
    rtt_seconds: float | None
    big: BigOutcome
    error: str | None = None


def summarize(
    history: Sequence[RoundOutcome],
    probes: int,
    *,
    down_after: int = 3,
    mtu_strikes: int = 3,
    target: IPv4Address | IPv6Address | None = None,
    label: str = "",
) -> ProbeResult:
    """Turn a peer's window of rounds (oldest first) into a ProbeResult."""
    sent = len(history)
    loss = sum(not r.small_ok for r in history) / sent if sent else 0.0
    recent = history[-down_after:] if down_after > 0 else history
    reachable = any(r.small_ok or r.big == "answered" for r in recent)
    rtt = next((r.rtt_seconds for r in reversed(history) if r.small_ok), None)
    return ProbeResult(
        reachable=reachable,
        rtt_seconds=rtt if reachable else None,
        loss_ratio=loss,
        mtu_ok=mtu_verdict(history, mtu_strikes),
        last_error=history[-1].error if history else None,
        probes=probes,
        target=target,
        label=label,
    )


def mtu_verdict(history: Sequence[RoundOutcome], strikes: int = 3) -> bool | None:
    """Newest evidence first: see the module docstring."""
    seen = 0
    for r in reversed(history):
        if r.big == "answered":
            return True
        if r.big == "refused":
            return False
        if r.big == "lost" and r.small_ok:
            seen += 1
            if seen >= strikes:
                return False
    return None


def needs_confirmation(latest: RoundOutcome, result: ProbeResult) -> bool:
    """True when the latest round failed but the verdict has not followed yet: the
    peer is probed again after an interval, not a cycle, until it does either way."""
    if not latest.small_ok:
        return result.reachable
    return latest.big == "lost" and result.mtu_ok is not False
