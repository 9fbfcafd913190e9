"""First-come first-served action-level scheduling without elasticity.

Every action gets exactly ``min_cores``; waiting actions start in submission
order among those that fit somewhere now (a head that fits nowhere does not
block other placement classes, which would only idle the pool).  A reward
call goes to a worker where its service is resident with a free slot, or
loads the service on another worker at once.  Same constraints as the
elastic scheduler (env affinity, memory, GPU memory, draining).  Priorities
are ignored: this is the plain action-level baseline.

As a set of strategies (:mod:`tangram_hpc.policy.placement`): :class:`~.order.SubmitOrder`,
:class:`~.grants.Grant` (``min_cores``), :class:`~.loading.LoadAtOnce`, and environment moves
by :class:`~.moves.MoveWhenSooner` when ``env_move_s`` is set.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ..resources import ServiceInfo, WorkerShape
from .base import mypyc_attr
from .grants import Grant
from .loading import LoadAtOnce
from .order import SubmitOrder
from .placement import PlacementPolicy
from .predict import Predictor
from .prefetch import Prefetch

__all__ = ["FifoPolicy"]


@mypyc_attr(allow_interpreted_subclasses=True)
class FifoPolicy(PlacementPolicy):
    def __init__(self, predictor: Predictor | None = None, *, shapes: Sequence[WorkerShape] = (),
                 services: Mapping[str, ServiceInfo] | None = None, pipeline_below_s: float | None = None,
                 env_move_s: float | None = None, prefetch: Prefetch | None = None):
        super().__init__(predictor, shapes=shapes, services=services, pipeline_below_s=pipeline_below_s,
                         env_move_s=env_move_s, order=SubmitOrder(), grant=Grant(), loading=LoadAtOnce(),
                         prefetch=prefetch)
