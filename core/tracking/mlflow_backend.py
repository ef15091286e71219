"""MLflow: one MLflow run per verlflow run (found again by its tag verlflow.run_id, so a rerun or a Retry resumes
it), the blueprint as params (core/tracking/params.py), metrics at their step number (core/metrics.step_numbers:
the iteration; a phased run's steps in plan order, each named by a tag verlflow.step.<n>), the promoted model's URI
and the Prefect flow run's page as tags.

The experiment is a model-training one: tagged mlflow.experimentKind (MLflow's record of an experiment's kind), and
the pages verlflow links carry ?workflowType=machine_learning, since MLflow 3.17's UI shows every experiment in the
workflow its GenAI / Model training switch names, GenAI (its empty traces pages) unless the URL names another
(tests/test_tracking.py opens the link in headless Chromium).

With no tracking.mlflow_uri the store is embedded: SQLite under the artifact root's tracking/ folder (places.py),
its artifacts beside it. The client talks to the URI directly (MlflowClient), so nothing process-wide is set."""

from __future__ import annotations

import os
import re

from verlflow.core.tracking.places import embedded_mlflow_uri, local_root
from verlflow.core.tracking.tracker import TrackedRun

RUN_TAG = "verlflow.run_id"
MODEL_TAG = "verlflow.promoted_model"
PREFECT_TAG = "verlflow.prefect_flow_run"
STEP_TAG = "verlflow.step"  # verlflow.step.<n>: the steps logged at step n of a phased run (evaluate[base])
KIND_TAG, TRAINING = "mlflow.experimentKind", "custom_model_development"  # mlflow's ExperimentKind values
TRAINING_VIEW = "?workflowType=machine_learning"
_BATCH = 100  # MLflow's log_batch takes at most 100 params (1000 metrics) per request


def mlflow_name(name: str) -> str:
    """MLflow names take letters, digits, _ - . space / and : only: eval/pass@4 is logged as eval/pass_at_4."""
    return re.sub(r"[^\w\-. /:]", "_", name.replace("@", "_at_"))[:250]


def open_backend(run: TrackedRun) -> "MlflowBackend":
    # A server that went down costs a few seconds once (the tracker then drops it), not MLflow's default of 7
    # retries with exponential backoff and 120 s timeouts per request; a user's own settings win.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    from mlflow.tracking import MlflowClient

    uri = run.bp.tracking.mlflow_uri or embedded_mlflow_uri(run.store)
    if not run.bp.tracking.mlflow_uri:
        local_root(run.store).mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=uri)
    return MlflowBackend(client, uri, _experiment_id(client, run), run)


def _experiment_id(client, run: TrackedRun) -> str:
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(run.experiment)
    if found is not None:
        _mark_training(client, found)
        return found.experiment_id
    # embedded: artifacts beside the database (the default would be ./mlruns under whatever folder the driver runs in)
    where = None if run.bp.tracking.mlflow_uri else (local_root(run.store) / "mlflow-artifacts").as_uri()
    try:
        return client.create_experiment(run.experiment, artifact_location=where, tags={KIND_TAG: TRAINING})
    except MlflowException:  # another run created it meanwhile
        return client.get_experiment_by_name(run.experiment).experiment_id


def _mark_training(client, experiment) -> None:
    """An experiment an earlier release created has no kind: it is a training one (a kind someone set stays)."""
    if KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, KIND_TAG, TRAINING)


class MlflowBackend:
    name = "mlflow"

    def __init__(self, client, uri: str, experiment_id: str, run: TrackedRun):
        self.client, self.uri, self.experiment_id = client, uri, experiment_id
        found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run.run_id}'",
                                   max_results=1)
        if found:
            self.run = found[0]
            client.update_run(self.run.info.run_id, status="RUNNING")
        else:
            self.run = client.create_run(experiment_id, run_name=run.run_id,
                                         tags={RUN_TAG: run.run_id, "verlflow.blueprint": run.bp.name})
        self.run_uuid = self.run.info.run_id
        self.target = f"mlflow:{self.run_uuid}"
        if run.prefect_url:  # this attempt's flow run (a rerun in a new flow run names that one)
            client.set_tag(self.run_uuid, PREFECT_TAG, run.prefect_url)
        self._log_params(run.params)

    @property
    def page(self) -> str:
        """The run's page under any MLflow UI's address, in the Model training view."""
        return f"#/experiments/{self.experiment_id}/runs/{self.run_uuid}{TRAINING_VIEW}"

    @property
    def url(self) -> str:
        """The run's page on a tracking server; for a store URI (sqlite://...), that URI."""
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/{self.page}"
        return self.uri

    def _log_params(self, params: dict[str, str]) -> None:
        """Params an earlier attempt logged stay (MLflow refuses to change one); the new ones are added."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        have = self.run.data.params
        new = [Param(mlflow_name(k), v[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items() if mlflow_name(k) not in have]
        for i in range(0, len(new), _BATCH):
            self.client.log_batch(self.run_uuid, params=new[i:i + _BATCH])

    def log(self, step: int, values: dict[str, float], wall_s: float, name: str | None = None) -> None:
        from mlflow.entities import Metric, RunTag

        ms = int(wall_s * 1000)
        batch = [Metric(mlflow_name(k), v, ms, step) for k, v in values.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_uuid, metrics=batch[i:i + 1000])
        if name:  # a phased run's step: its name beside its number
            self.client.log_batch(self.run_uuid, tags=[RunTag(f"{STEP_TAG}.{step}", name)])

    def tag_model(self, iteration: int | str, uri: str, step: int | None) -> None:
        self.client.set_tag(self.run_uuid, MODEL_TAG, uri)
        self.client.set_tag(self.run_uuid, "verlflow.promoted_iteration", str(iteration))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_uuid, status=status)
