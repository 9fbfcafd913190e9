"""Where each stateful environment lives: one live copy, fenced by a generation number.

Socket-free, clock-free and file-free, like the ledger that drives it.  An
environment is one of:

========== ====================================================================
status     meaning
========== ====================================================================
LIVE       one worker (``holder``) has the live copy; its actions run there
MOVING     its holder is handing it back (drain, leave, or the policy moves it): actions wait
SAVED      a snapshot (``source``) is the live state; the next worker restores it
AWAITED    its holder was declared lost but may come back (a hang, SIGSTOP): actions
           wait up to ``wait_s``
ORPHANED   its holder died; its directory (under ``source``, the dead worker's
           environment root) is the state; the next worker adopts it
LOST       no copy can be reached: its actions fail with ``env_lost`` until the
           client closes it
========== ====================================================================

Every grant of an environment to a worker takes a new *generation* from one
counter: a copy, a snapshot or a hand-back that names an older generation is
fenced off (ignored, its snapshot deleted, a returning worker told to drop
it), so there is never more than one copy that actions run in.  A worker
declared lost loses its right to its environments; if it comes back before
``wait_s`` with the copy it was last granted, it is granted it again (no
other copy exists: its actions waited).  The ledger holds back the actions of
an environment that is not usable and calls :meth:`grant` when the policy
starts one.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .. import protocol as P


class EnvStatus(str, Enum):
    LIVE = "live"
    MOVING = "moving"
    SAVED = "saved"
    AWAITED = "awaited"
    ORPHANED = "orphaned"
    LOST = "lost"

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]


#: Environments whose actions may be given to the scheduling policy.
USABLE = frozenset({EnvStatus.LIVE, EnvStatus.SAVED, EnvStatus.ORPHANED})
_HELD = frozenset({EnvStatus.LIVE, EnvStatus.MOVING})


@dataclass(slots=True)
class EnvRecord:
    id: str
    gen: int
    status: EnvStatus
    holder: str | None = None      # worker id: LIVE, MOVING, AWAITED
    last_holder: str | None = None # the worker that held it last (ORPHANED: the one that died)
    source: str | None = None      # SAVED: the snapshot; ORPHANED: the dead worker's environment root
    running: int = 0               # attempts the ledger has running in it
    since: float = 0.0             # AWAITED since
    save_sent: bool = False        # MOVING: the holder was asked (or offered) to save it
    why: str = ""                  # LOST: why

    def wire(self) -> list:
        return [self.id, str(self.status), self.gen, self.holder, self.source, self.why]


class EnvironmentDirectory:
    """The coordinator's map of environments; ``wait_s``: how long a lost worker's are awaited."""

    def __init__(self, wait_s: float = 120.0, *, tombstones: int = 100_000):
        self.wait_s = wait_s
        self.envs: dict[str, EnvRecord] = {}
        self.by_worker: dict[str, set[str]] = {}   # worker id -> envs it holds (LIVE, MOVING, AWAITED)
        self.roots: dict[str, str] = {}            # worker id -> its environment root directory
        self.handles: dict[str, str] = {}          # backend handle -> worker id (to learn a lost one died)
        self.counter = 0                           # the last generation handed out
        #: state-file records since the last flush: [env, status, gen, holder, source, why] (status None:
        #: forgotten) and ["", "counter", n]
        self.changes: list[list] = []
        #: snapshots and directories that no longer hold a live state: the I/O side deletes them
        self.garbage: list[tuple[str, str | None]] = []   # (path, env id for a worker root, else None)
        self._awaited: set[str] = set()
        self._closed: dict[str, int] = {}          # env -> generation it was closed at (bounded)
        self._tomb_cap = tombstones

    # -- views -----------------------------------------------------------------
    def get(self, env: str) -> EnvRecord | None:
        return self.envs.get(env)

    def held_by(self, worker: str) -> frozenset[str]:
        """Environments live on ``worker`` (what the scheduling policy pins to it)."""
        envs = self.envs
        return frozenset(e for e in self.by_worker.get(worker, ()) if envs[e].status is EnvStatus.LIVE)

    def moving_from(self, worker: str) -> bool:
        envs = self.envs
        return any(envs[e].status is EnvStatus.MOVING for e in self.by_worker.get(worker, ()))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.envs.values():
            out[r.status] = out.get(r.status, 0) + 1
        return out

    # -- granting ----------------------------------------------------------------
    def _next_gen(self) -> int:
        self.counter += 1
        self.changes.append(["", "counter", self.counter])
        return self.counter

    def _changed(self, rec: EnvRecord) -> None:
        self.changes.append(rec.wire())

    def _hold(self, rec: EnvRecord, worker: str) -> None:
        rec.holder = worker
        self.by_worker.setdefault(worker, set()).add(rec.id)

    def _release(self, rec: EnvRecord) -> None:
        if rec.holder is not None:
            rec.last_holder = rec.holder
            held = self.by_worker.get(rec.holder)
            if held is not None:
                held.discard(rec.id)
                if not held:
                    del self.by_worker[rec.holder]
        rec.holder = None
        self._awaited.discard(rec.id)

    def grant(self, env: str, worker: str) -> list | None:
        """An action of ``env`` starts on ``worker``: the grant its ASSIGN carries, or None when the
        environment is not this worker's to use (held elsewhere, moving, awaited or lost)."""
        rec = self.envs.get(env)
        if rec is None:
            rec = self.envs[env] = EnvRecord(env, self._next_gen(), EnvStatus.LIVE)
            self._closed.pop(env, None)
            self._hold(rec, worker)
            grant = [rec.gen, P.GRANT_NEW, None]
        elif rec.status is EnvStatus.LIVE:
            if rec.holder != worker:
                return None
            grant = [rec.gen, P.GRANT_HELD, None]
        elif rec.status is EnvStatus.SAVED or rec.status is EnvStatus.ORPHANED:
            gen = self._next_gen()
            grant = [gen, P.GRANT_RESTORE if rec.status is EnvStatus.SAVED else P.GRANT_ADOPT, rec.source]
            rec.gen, rec.status, rec.source = gen, EnvStatus.LIVE, None
            self._hold(rec, worker)
        else:
            return None
        if grant[1] != P.GRANT_HELD:
            self._changed(rec)
        rec.running += 1
        return grant

    def ended(self, env: str) -> tuple[str, int] | None:
        """An attempt in ``env`` ended; returns (holder, generation) when it should now be asked to save it."""
        rec = self.envs.get(env)
        if rec is None:
            return None
        if rec.running > 0:
            rec.running -= 1
        if rec.status is EnvStatus.MOVING and rec.running == 0 and not rec.save_sent:
            rec.save_sent = True
            return rec.holder, rec.gen
        return None

    # -- moving ------------------------------------------------------------------
    def worker_draining(self, worker: str, *, ask: bool) -> tuple[list[str], list[tuple[str, int]]]:
        """``worker`` gives its environments up.  ``ask``: the coordinator asks it to save each one
        when nothing runs there (drain); otherwise it saves them on its own (it is leaving).

        Returns (environments now moving, (env, generation) to ask it to save now).
        """
        moving, save_now = [], []
        for env in sorted(self.by_worker.get(worker, ())):
            rec = self.envs[env]
            if rec.status is not EnvStatus.LIVE:
                continue
            moving.append(env)
            if self._start_move(rec, ask=ask):
                save_now.append((env, rec.gen))
        return moving, save_now

    def move(self, env: str) -> tuple[str, int, bool] | None:
        """Move one live environment off its holder (the scheduling policy wants it elsewhere): the
        holder is asked to save it once nothing runs in it.  Returns (holder, generation, whether to
        ask it now), or None when it is not live on a worker."""
        rec = self.envs.get(env)
        if rec is None or rec.status is not EnvStatus.LIVE or rec.holder is None:
            return None
        return rec.holder, rec.gen, self._start_move(rec, ask=True)

    @staticmethod
    def _start_move(rec: EnvRecord, *, ask: bool) -> bool:
        """LIVE -> MOVING; True when the holder should be asked to save it now."""
        rec.status = EnvStatus.MOVING
        rec.save_sent = not ask or rec.running == 0
        return ask and rec.running == 0

    def saved(self, worker: str, env: str, gen: int, path: str) -> bool:
        """The holder saved ``env`` at ``gen`` to ``path`` and gave its copy up.  False when fenced
        (the snapshot is then garbage)."""
        rec = self.envs.get(env)
        # An orphaned environment nobody adopted yet (same generation) may still be handed back by the
        # worker believed dead: its snapshot is the state, its directory may be gone already.
        orphan = rec is not None and rec.status is EnvStatus.ORPHANED and rec.last_holder == worker
        if rec is None or rec.gen != gen or not (orphan or rec.holder == worker and rec.status in (
                EnvStatus.MOVING, EnvStatus.LIVE, EnvStatus.AWAITED)):
            self.garbage.append((path, None))
            return False
        self._release(rec)
        rec.status, rec.source, rec.running = EnvStatus.SAVED, path, 0
        self._changed(rec)
        return True

    def unsaved(self, worker: str, env: str, gen: int) -> bool:
        """The holder could not save ``env``: it stays where it is (True when that changed anything)."""
        rec = self.envs.get(env)
        if rec is None or rec.gen != gen or rec.holder != worker or rec.status is not EnvStatus.MOVING:
            return False
        rec.status, rec.save_sent = EnvStatus.LIVE, False
        return True

    def gone(self, worker: str, env: str, gen: int) -> bool:
        """The holder removed ``env`` itself (its idle TTL passed): the environment has ended."""
        rec = self.envs.get(env)
        if rec is None or rec.gen != gen or rec.holder != worker:
            return False
        self._forget(rec)
        return True

    # -- workers -------------------------------------------------------------------
    def worker_registered(self, worker: str, root: str | None, handle: str | None, reported: list,
                          now: float) -> tuple[list[list], list[list], list[str], list[str]]:
        """A worker registered (again) with the environments it has on disk, ``[[env, gen], ...]``.

        Returns (ENV keep items, ENV drop items, environments regained, environments now lost).
        A copy is kept only when it is the one the worker was last granted and nothing replaced
        it meanwhile; any other copy is fenced off.
        """
        if root and self.roots.get(worker) != root:
            self.roots[worker] = root
            self.changes.append(["", "root", worker, root])
        if handle:
            self.handles[handle] = worker
        keep, drop, regained, lost = [], [], [], []
        kept = set()
        for env, gen in reported:
            rec = self.envs.get(env)
            if rec is None:
                closed = self._closed.get(env)
                if closed is not None and gen <= closed:
                    drop.append([P.ENV_DROP, env, gen])
                    continue
                # Unknown here (a coordinator that lost its state file): the worker's copy is all there is.
                rec = self.envs[env] = EnvRecord(env, 0, EnvStatus.LIVE)
            elif not (rec.holder == worker and rec.gen == gen and rec.status in (EnvStatus.AWAITED, *_HELD)):
                drop.append([P.ENV_DROP, env, gen])
                continue
            self._release(rec)
            rec.gen, rec.status, rec.running, rec.save_sent = self._next_gen(), EnvStatus.LIVE, 0, False
            self._hold(rec, worker)
            self._changed(rec)
            keep.append([P.ENV_KEEP, env, rec.gen])
            regained.append(env)
            kept.add(env)
        for env in [e for e in self.by_worker.get(worker, ()) if e not in kept]:
            rec = self.envs[env]
            if rec.status is EnvStatus.AWAITED:
                self._lose(rec, f"its worker {worker} came back without it")
                lost.append(env)
        return keep, drop, regained, lost

    def worker_lost(self, worker: str, *, dead: bool, now: float) -> list[str]:
        """``worker`` is gone; ``dead``: known to have exited (else it may come back).  Returns the
        environments it held, now AWAITED, ORPHANED or LOST."""
        out = []
        for env in sorted(self.by_worker.get(worker, ())):
            rec = self.envs[env]
            if rec.status is EnvStatus.AWAITED:
                continue
            rec.running = 0
            if dead:
                self._orphan(rec, worker)
            else:
                rec.status, rec.since = EnvStatus.AWAITED, now
                self._awaited.add(env)
                self._changed(rec)
            out.append(env)
        if dead:
            self.roots.pop(worker, None)
        return out

    def worker_dead(self, worker: str) -> list[str]:
        """A worker lost earlier is now known to have exited: its awaited environments are orphaned."""
        out = []
        for env in sorted(self.by_worker.get(worker, ())):
            rec = self.envs[env]
            if rec.status is EnvStatus.AWAITED:
                self._orphan(rec, worker)
                out.append(env)
        self.roots.pop(worker, None)
        return out

    def worker_of_handle(self, handle: str) -> str | None:
        return self.handles.get(handle)

    def awaited(self) -> list[EnvRecord]:
        """The environments whose worker is awaited, from the set kept of them: looked for every two
        seconds (snapshots written meanwhile), a scan of 100,000 records was most of an idle tick."""
        envs = self.envs
        return [rec for env in self._awaited if (rec := envs.get(env)) is not None and rec.status is EnvStatus.AWAITED]

    def expire(self, now: float) -> list[str]:
        """Environments awaited longer than ``wait_s``: orphaned (adopted from the worker's
        directory by the next worker) or, when that directory is not known, lost."""
        if not self._awaited:
            return []
        out = []
        for env in sorted(self._awaited):
            rec = self.envs[env]
            if now - rec.since >= self.wait_s:
                self._orphan(rec, rec.holder, f"its worker {rec.holder} was silent for {self.wait_s:g}s")
                out.append(env)
        return out

    def _orphan(self, rec: EnvRecord, worker: str | None, why: str = "") -> None:
        root = self.roots.get(worker) if worker else None
        self._release(rec)
        rec.running = 0
        if root:
            rec.status, rec.source = EnvStatus.ORPHANED, root
            self._changed(rec)
        else:
            self._lose(rec, why or f"its worker {worker} died and did not say where its environments are")

    def _lose(self, rec: EnvRecord, why: str) -> None:
        self._release(rec)
        rec.status, rec.source, rec.why, rec.running = EnvStatus.LOST, None, why, 0
        self._changed(rec)

    # -- ending ------------------------------------------------------------------
    def close(self, env: str) -> list | None:
        """The client ended ``env`` (nothing of it runs): forget it.  Returns the ENV drop item for its
        holder, if a worker holds it."""
        rec = self.envs.get(env)
        if rec is None:
            return None
        holder = rec.holder if rec.status in _HELD else None
        item = [P.ENV_DROP, env, rec.gen] if holder is not None else None
        if rec.status is EnvStatus.SAVED:
            self.garbage.append((rec.source, None))
        elif rec.status is EnvStatus.ORPHANED:
            self.garbage.append((rec.source, env))
        self._forget(rec)
        return [holder, item] if item is not None else None

    def _forget(self, rec: EnvRecord) -> None:
        self._release(rec)
        del self.envs[rec.id]
        self._closed[rec.id] = self.counter
        if len(self._closed) > self._tomb_cap:
            for old in list(self._closed)[:self._tomb_cap // 2]:
                del self._closed[old]
        self.changes.append([rec.id, None, 0, None, None, ""])

    # -- restart -------------------------------------------------------------------
    def load(self, records: list, now: float) -> None:
        """State-file records (as :attr:`changes` wrote them, the last per environment wins).

        Environments a worker held become AWAITED: their worker re-registers with them, or hands
        them back, or is given up after ``wait_s``.
        """
        latest: dict[str, list] = {}
        for r in records:
            if not isinstance(r, list) or not r or not isinstance(r[0], str):
                continue
            if r[0] == "":      # ["", "counter", n] or ["", "root", worker, root]
                if len(r) == 3 and r[1] == "counter" and isinstance(r[2], int):
                    self.counter = max(self.counter, r[2])
                elif len(r) == 4 and r[1] == "root" and isinstance(r[2], str) and isinstance(r[3], str):
                    self.roots[r[2]] = r[3]
                continue
            if len(r) == 6:
                latest[r[0]] = r
        for env, status, gen, holder, source, why in latest.values():
            if status is None or not isinstance(gen, int):
                continue
            try:
                st = EnvStatus(status)
            except ValueError:
                continue
            rec = EnvRecord(env, gen, st, source=source, why=why or "")
            self.counter = max(self.counter, gen)
            self.envs[env] = rec
            if st in _HELD or st is EnvStatus.AWAITED:
                if holder is None:
                    self._lose(rec, "held by an unknown worker before the coordinator restarted")
                    continue
                rec.status, rec.since = EnvStatus.AWAITED, now
                self._hold(rec, holder)
                self._awaited.add(env)
        self.roots = {w: r for w, r in self.roots.items() if w in self.by_worker}
        self.changes = self.snapshot_records()

    def snapshot_records(self) -> list[list]:
        """The whole state as records (to compact the state file)."""
        out: list[list] = [["", "counter", self.counter]]
        out += [["", "root", w, root] for w, root in self.roots.items()]
        out += [r.wire() for r in self.envs.values()]
        return out

    def found_snapshot(self, env: str, gen: int, path: str) -> bool:
        """A snapshot of ``env`` at ``gen`` appeared (written by a worker leaving while no coordinator
        could hear it): it is the live state if the environment was awaited at that generation."""
        rec = self.envs.get(env)
        if rec is None or rec.status is not EnvStatus.AWAITED or rec.gen != gen:
            return False
        self._release(rec)
        rec.status, rec.source = EnvStatus.SAVED, path
        self._changed(rec)
        return True
