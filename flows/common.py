"""What both flows need: the blueprint (parameter or file/URI), the run id, the flow run's own facts."""

import datetime as dt
import tempfile

from prefect.client.orchestration import get_client
from prefect.context import get_run_context

from core.blueprint import Blueprint, load_blueprint
from core.pipeline import Step
from core.runner import open_store
from core.store import stage_key


def resolve_blueprint(blueprint: Blueprint, blueprint_file: str | None) -> Blueprint:
    """A blueprint file (a path, or any fsspec URI such as s3://...) wins over the parameter."""
    if not blueprint_file:
        return blueprint
    if "://" in blueprint_file and not blueprint_file.startswith("file://"):
        import fsspec

        with fsspec.open(blueprint_file, "rb") as f, tempfile.NamedTemporaryFile(suffix=".yaml", delete=False) as t:
            t.write(f.read())
        return load_blueprint(t.name)
    return load_blueprint(blueprint_file.removeprefix("file://"))


def default_run_id(bp: Blueprint) -> str:
    """`<name>-<first 8 hex of the flow run id>`: a UI Retry (same flow run) resumes the same run; every
    scheduled run of a deployment gets its own."""
    return f"{bp.name}-{str(get_run_context().flow_run.id)[:8]}"


def name_flow_run(run_id: str) -> None:
    """Show the run id as the flow run's name in the UI."""
    with get_client(sync_client=True) as client:
        client.update_flow_run(get_run_context().flow_run.id, name=run_id)


def recomputed_here(bp: Blueprint, run_id: str, step: Step) -> bool:
    """Whether this flow run already recomputed `step` (committed after the flow run was created), so a Retry
    of a run started with from_step does not force the same stages again."""
    m = open_store(bp).read_manifest(stage_key(run_id, step.iteration, step.stage))
    if m is None or not m.get("committed_at"):
        return False
    created = int(get_run_context().flow_run.created.timestamp())  # committed_at has whole seconds
    return dt.datetime.fromisoformat(m["committed_at"]).timestamp() >= created

