"""Sibling subtrees taking turns, their batched device steps merged (``runtime.batch_siblings``).

In process, the root's children (level-1 nodes and their subtrees) used to fit one after the
other, each stepping only its own devices together (hfl.accel.batched): PerMFL's preset is 4 teams x
K = 10 team rounds, 40 phases of 10 devices a global round, each step paying ~30 small ops for
10 devices. Here each child's fit runs in a thread of its own, but only one thread runs at a
time, in a fixed order (a baton passed round-robin), so nothing they share is ever touched
concurrently and runs stay reproducible. A thread that reaches a batched step hands its request
to ``submit`` and passes the baton on; once every child still fitting has a request waiting,
the last one runs them all as one computation (``execute``), and the children resume in order,
each with its own results. A child that needs fewer steps simply finishes and drops out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

# party requests, in party order -> one outcome each (a result, or the exception it raises)
Execute = Callable[[list[Any]], list[Any]]

_current = threading.local()


def current_submit() -> Callable[[Any], Any] | None:
    """The ``submit`` of the lockstep this thread is a party of (None outside one)."""
    return getattr(_current, "submit", None)


class Lockstep:
    """Runs ``tasks`` as parties taking turns (see the module); ``execute`` merges the requests
    the parties ``submit``. An exception ``execute`` returns for a request is raised in its party."""

    def __init__(self, execute: Execute) -> None:
        self._execute = execute
        self._cond = threading.Condition()
        self._live: list[int] = []
        self._turn: int | None = None
        self._waiting: dict[int, Any] = {}  # party -> its request, until executed
        self._outcomes: dict[int, Any] = {}
        self.batches: list[int] = []  # parties merged in each execution (tests, inspection)

    def run(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Each task's return value, or the exception it raised, in task order."""
        out: list[Any] = [None] * len(tasks)
        self._live, self._turn = list(range(len(tasks))), 0 if tasks else None
        threads = [threading.Thread(target=self._party, args=(i, task, out), daemon=True, name=f"hfl-party-{i}")
                   for i, task in enumerate(tasks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return out

    def _party(self, i: int, task: Callable[[], Any], out: list[Any]) -> None:
        _current.submit = lambda request: self._submit(i, request)
        try:
            with self._cond:
                self._cond.wait_for(lambda: self._turn == i)
            out[i] = task()
        except BaseException as exc:  # noqa: BLE001 - the caller counts it as the task's failure
            out[i] = exc
        finally:
            _current.submit = None
            with self._cond:
                self._live.remove(i)
                self._pass_on(i)

    def _submit(self, i: int, request: Any) -> Any:
        with self._cond:
            self._waiting[i] = request
            self._pass_on(i)
            self._cond.wait_for(lambda: self._turn == i and i in self._outcomes)
            outcome = self._outcomes.pop(i)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _pass_on(self, i: int) -> None:
        """Party ``i`` has submitted or finished (the lock held): the baton goes to the next party
        still running; with none, the waiting requests are executed and the first party resumes."""
        running = [p for p in self._live if p not in self._waiting]
        if running:
            self._turn = next((p for p in running if p > i), running[0])
        else:
            if self._waiting:
                parties = sorted(self._waiting)
                requests = [self._waiting.pop(p) for p in parties]
                self.batches.append(len(parties))
                self._outcomes.update(zip(parties, self._safely(requests), strict=True))
            self._turn = self._live[0] if self._live else None
        self._cond.notify_all()

    def _safely(self, requests: list[Any]) -> list[Any]:
        """``execute``'s outcomes, never raising (the baton must move on); should it fail as a
        whole, each request alone, so that one party's failure is not every party's."""
        try:
            outcomes = self._execute(requests)
            if len(outcomes) == len(requests):
                return outcomes
            error: BaseException = RuntimeError(f"lockstep: {len(outcomes)} outcomes for {len(requests)} requests")
        except BaseException as exc:  # noqa: BLE001 - raised in the party (or parties) it belongs to
            error = exc
        if len(requests) == 1:
            return [error]
        outcomes = []
        for request in requests:
            try:
                outcomes.append(self._execute([request])[0])
            except BaseException as exc:  # noqa: BLE001
                outcomes.append(exc)
        return outcomes
