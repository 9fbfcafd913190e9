"""The coordinator: a socket-free core and the thin ZMQ loop around it.

* :class:`ActionLedger` (``ledger.py``): every live action, attempts,
  timeouts, cancels, one final result each; it is the only caller of the
  scheduling policy's event methods;
* :class:`~.membership.WorkerMembership` (``membership.py``): workers
  registering, reporting, draining, leaving and lost, for the ledger;
* :class:`~.lifecycle.EnvironmentLifecycle` (``lifecycle.py``): the stateful
  environments of the ledger's actions (held actions, grants, moves,
  kill-on-return, the attempt log), over the ``EnvironmentDirectory``;
  :class:`~.answers.ClientAnswers` (``answers.py``): the result cache,
  idempotency keys and kept outcomes;
* :class:`WorkerRegistry` (``registry.py``): registered workers and what they
  last reported;
* :class:`PoolDriver` (``pool_driver.py``): runs the pool policy against a
  worker backend;
* :class:`Outbox` (``outbox.py``): what those want sent, flushed by
* :class:`Coordinator` (``server.py``): the two ROUTER sockets, frame
  decoding and the periodic tick.

All but the last take the clock as ``now`` and never touch a socket, so tests
drive them in-process and read the outbox.
"""
from .ledger import ActionLedger
from .outbox import Counters, Outbox
from .pool_driver import PoolDriver
from .registry import WorkerRecord, WorkerRegistry, WorkerState
from .server import Coordinator

__all__ = ["ActionLedger", "Coordinator", "Counters", "Outbox", "PoolDriver",
           "WorkerRecord", "WorkerRegistry", "WorkerState"]
