"""Which resident service to evict when a device is full (pure; no clock, no threads).

One rule for everybody: the live :class:`~tangram_hpc.managers.services.ServiceManager`
applies it on a worker, the simulator applies it to its simulated workers, and
the placement policy applies it to predict what a load would evict (so it can
avoid a worker where the load would push out a model that is needed soon).

The *value* of keeping a service resident is what evicting it would cost the
actions still to come, discounted by how long it has been unused::

    value = (1 + pending_inputs) * (reload_s + evict_s + 0.01) / (1 + idle_s)

* ``pending_inputs``: inputs already waiting for it -- evicting a service
  with queued demand means paying its reload almost at once;
* ``reload_s + evict_s``: the measured cost of a round trip (host RAM to
  device and back), so a cheap-to-restore service goes before a costly one;
* ``idle_s``: seconds since it last scored -- the LRU part: long-unused
  services lose value.

Victims are taken in increasing value until the new service fits; victims
that turn out not to be needed (a larger one freed enough) are given back.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Resident", "eviction_value", "choose_victims"]

#: Seconds added to the measured round trip so services never measured (and a
#: zero-cost round trip) still order by demand and recency.
_COST_FLOOR_S = 0.01


@dataclass(slots=True, frozen=True)
class Resident:
    """A resident service as the eviction policy sees it (evictable: not in use)."""

    name: str
    memory_mb: float
    pending_inputs: int
    idle_s: float
    reload_s: float
    evict_s: float

    def __reduce__(self) -> tuple:      # see Launch.__reduce__
        return (Resident, (self.name, self.memory_mb, self.pending_inputs, self.idle_s, self.reload_s,
                           self.evict_s))


def eviction_value(r: Resident) -> float:
    return (1 + r.pending_inputs) * (r.reload_s + r.evict_s + _COST_FLOOR_S) / (1.0 + max(0.0, r.idle_s))


def choose_victims(residents: list[Resident], need_mb: float, free_mb: float) -> list[str] | None:
    """Names to evict so that ``need_mb`` fits, least valuable first; None if impossible."""
    if free_mb >= need_mb:
        return []
    # Ties (equal value) evict the larger service first: fewer moves free the room.
    order = sorted(residents, key=lambda r: (eviction_value(r), -r.memory_mb, r.name))
    chosen: list[Resident] = []
    freed = free_mb
    for r in order:
        if freed >= need_mb:
            break
        chosen.append(r)
        freed += r.memory_mb
    if freed < need_mb:
        return None
    # Keep the most valuable victims whose room is not needed after all.
    for r in sorted(chosen, key=eviction_value, reverse=True):
        if freed - r.memory_mb >= need_mb:
            chosen.remove(r)
            freed -= r.memory_mb
    return [r.name for r in chosen]
