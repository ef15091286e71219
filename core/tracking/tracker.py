"""The Tracker the pipeline drives: opens the blueprint's backends, logs each committed step once, tags the
promoted model and closes with the run's status. A backend that fails is dropped with one warning."""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import logging
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from verlflow.core import metrics
from verlflow.core.blueprint import Blueprint
from verlflow.core.store.artifacts import ArtifactStore
from verlflow.core.tracking.params import blueprint_params
from verlflow.core.tracking.places import ledger_key, local_root

log = logging.getLogger("verlflow.tracking")

# backend name -> module (named *_backend so that it never shadows the library it drives)
BACKENDS = {"mlflow": "verlflow.core.tracking.mlflow_backend",
            "tensorboard": "verlflow.core.tracking.tensorboard_backend",
            "wandb": "verlflow.core.tracking.wandb_backend"}


@dataclass(frozen=True)
class TrackedRun:
    """What a backend opens with."""
    bp: Blueprint
    run_id: str
    store: ArtifactStore
    params: dict[str, str]
    prefect_url: str | None = None  # the Prefect UI page of the flow run tracking it

    @property
    def experiment(self) -> str:
        return self.bp.tracking.experiment or self.bp.name

    @property
    def local_root(self):
        return local_root(self.store)


class Backend(Protocol):
    name: str
    target: str  # where it logs, e.g. mlflow:<run uuid>: the ledger is kept per destination

    # step: core/metrics.step_numbers; name: the steps logged there (`evaluate[base]`), None where step = iteration
    def log(self, step: int, values: dict[str, float], wall_s: float, name: str | None = None) -> None: ...

    # step: the step number of the exported policy's last step with metrics (None: it has none)
    def tag_model(self, iteration: int | str, uri: str, step: int | None) -> None: ...

    def close(self, status: str) -> None: ...  # FINISHED, FAILED or KILLED


def commit_id(manifest: dict) -> str:
    """Which commit of a step: a recomputed step (--from) commits anew, a reused or re-pruned one keeps it."""
    return f"{manifest['key']}@{manifest.get('committed_at')}"


def commit_time(manifest: dict) -> float:
    at = manifest.get("committed_at")
    return _dt.datetime.fromisoformat(at).timestamp() if at else _dt.datetime.now().timestamp()


class Tracker:
    """Opens its backends at the first step after validate: a run that validate refuses leaves no tracker run (and
    nothing in the store) behind."""

    def __init__(self, bp: Blueprint, run_id: str, store: ArtifactStore):
        self.bp, self.run_id, self.store = bp, run_id, store
        self.backends: list[Backend] | None = None  # None: not opened yet
        self.ledger: dict = {}
        self._steps: tuple[dict[str, int], dict[int, str]] | None = None  # the plan's step numbers and names
        self._pending: dict[str, int] = {}  # steps whose commit is still in the background: their numbers
        self._held: dict[str, tuple[int, str, object, dict]] = {}  # committed, waiting for an earlier pending step

    def _open(self) -> None:
        run = TrackedRun(self.bp, self.run_id, self.store, blueprint_params(self.bp), prefect_flow_run_url())
        self.backends = []
        for name in self.bp.tracking.backends:
            try:
                self.backends.append(importlib.import_module(BACKENDS[name]).open_backend(run))
            except Exception as e:  # a tracker that cannot start does not stop the training
                _warn(name, "start", e)
        self.ledger = self._read_ledger()
        for b in self.backends:
            if b.name == "mlflow":
                self.ledger.update(mlflow_url=b.url, mlflow_page=b.page)
        self._save()

    def step(self, stage: str, iteration, manifest: dict | None) -> None:
        """Log a committed step's metrics (core/metrics.PREFIX's stages) at its step number, once per commit, in
        step order: a step committed while an earlier one's commit is still in the background waits for it.
        Logged as they came, evaluate[1] went into TensorBoard's event file before evaluate[tuned] (whose commit
        landed at the run's end), and every reader of the file saw that tag's points out of step order."""
        if stage == "validate":
            return
        if self.backends is None:
            self._open()
        if stage not in metrics.PREFIX or not manifest or not self.backends:
            return
        name, number = f"{stage}[{iteration}]", self._number(iteration)[0]
        if manifest.get("pending"):  # several steps share a number (rollout[1], update[1]): kept by name
            self._pending[name] = number
            return
        self._pending.pop(name, None)
        self._held[name] = (number, stage, iteration, manifest)
        first_pending = min(self._pending.values(), default=None)
        for name, (n, st, it, m) in sorted(self._held.items(), key=lambda kv: kv[1][0]):
            if first_pending is not None and n > first_pending:
                break
            del self._held[name]
            self._log(st, it, m)

    def _log(self, stage: str, iteration, manifest: dict) -> None:
        name, done = f"{stage}[{iteration}]", commit_id(manifest)
        number, label = self._number(iteration)
        values = metrics.flat(stage, manifest.get("metrics", {}))

        def log_once(b: Backend) -> None:
            logged = self.ledger.setdefault("logged", {}).setdefault(b.target, {})
            if logged.get(name) != done:
                b.log(number, values, commit_time(manifest), label)
                logged[name] = done

        self._each(f"log {name}", log_once)
        self._save()

    def _number(self, iteration) -> tuple[int, str | None]:
        """The step number of an iteration, and for a named one (a phase's) the names of the steps logged there."""
        numbers, names = self._plan_steps()
        number = numbers[str(iteration)]
        return number, None if str(number) == str(iteration) else names[number]

    def _plan_steps(self) -> tuple[dict[str, int], dict[int, str]]:
        if self._steps is None:
            from verlflow.core.orchestrate.pipeline import plan  # it imports this module

            pairs = [(s.stage, s.iteration) for s in plan(self.bp, self.run_id)]
            self._steps = metrics.step_numbers(pairs), metrics.step_names(pairs)
        return self._steps

    def promoted(self) -> None:
        """Tag the model the run's `latest` pointer names (verlflow.core.store.promote), if any."""
        pointer = self.store.get_pointer(f"runs/{self.run_id}/latest") if self.backends else None
        if pointer and pointer.get("hf_uri"):
            it, numbers = pointer.get("iteration"), self._plan_steps()[0]
            step = numbers.get(str(it), max(numbers.values(), default=None))  # export[dpo]: the run's last step
            self._each("tag the promoted model", lambda b: b.tag_model(it, pointer["hf_uri"], step))

    def close(self, status: str) -> None:
        for n, st, it, m in sorted(self._held.values(), key=lambda held: held[0]):  # a failed run: what it committed
            self._log(st, it, m)
        self._held.clear()
        self._each(f"close ({status})", lambda b: b.close(status))
        self.backends = []

    def _each(self, action: str, call: Callable[[Backend], None]) -> None:
        """`call` on each live backend; one that raises is dropped with a warning and the rest go on."""
        for b in list(self.backends or ()):
            try:
                call(b)
            except Exception as e:
                self.backends.remove(b)
                _warn(b.name, action, e)

    def _read_ledger(self) -> dict:
        key = ledger_key(self.run_id)
        try:
            return json.loads(self.store.get_bytes(key)) if self.store.exists(key) else {}
        except ValueError:  # a torn write: steps already logged may be logged again
            log.warning("tracking: %s is unreadable; starting a new ledger", self.store.uri(key))
            return {}

    def _save(self) -> None:
        self.store.put_bytes(ledger_key(self.run_id), json.dumps(self.ledger, indent=1, sort_keys=True).encode())


def prefect_flow_run_url() -> str | None:
    """The UI page of the Prefect flow run this runs in (PREFECT_UI_URL, by default the API's address without /api);
    None outside a flow run (the CLI, which never imports Prefect)."""
    context = sys.modules.get("prefect.context")
    ctx = context.FlowRunContext.get() if context is not None else None
    if ctx is None or ctx.flow_run is None:
        return None
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=ctx.flow_run.id)


def _warn(name: str, action: str, e: Exception) -> None:
    log.warning("tracking: %s failed to %s (%s: %s); the run goes on without %s; a rerun of the run logs the steps "
                "it missed", name, action, type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "", name)


@contextmanager
def tracked(bp: Blueprint, run_id: str, store: ArtifactStore, enabled: bool = True) -> Iterator[Tracker]:
    """The run's tracker, closed FINISHED, or FAILED (KILLED on an interrupt) if the block raises."""
    tracker = Tracker(bp, run_id, store) if enabled and bp.tracking.backends else _Off()
    try:
        yield tracker
    except KeyboardInterrupt:
        tracker.close("KILLED")
        raise
    except BaseException:
        tracker.close("FAILED")
        raise
    tracker.close("FINISHED")


class _Off:
    """No backends (tracking.backends: []), or a follower node (node 0 tracks)."""

    def step(self, stage, iteration, manifest) -> None:
        pass

    def promoted(self) -> None:
        pass

    def close(self, status: str) -> None:
        pass
