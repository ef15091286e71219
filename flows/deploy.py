"""Deployments of a blueprint: its full object is the default parameters (the UI form shows its values), and the
form is its schema as a person fills it in (`run_form`).

`deploy`: a deployment on a process work pool, run by `prefect worker start --pool POOL` (infra/README.md).
`serve`: the embedded single-machine setup; this process polls for the deployments' runs and executes them.
"""

import re

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentScheduleCreate, WorkPoolCreate
from prefect.deployments.runner import DeploymentApplyError, EntrypointType, RunnerDeployment
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
from prefect.schedules import Cron
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES
from prefect.utilities.callables import ParameterSchema

from verlflow.core.blueprint import Blueprint
from verlflow.core.errors import PrefectServerError
from verlflow.flows.common import turn_limit
from verlflow.flows.finetune import finetune
from verlflow.flows.validate import validate


BLUEPRINT_SCHEDULE = "blueprint-cron"  # slug of the one schedule the blueprint (or --cron) owns

BACKENDS = ("slurm", "kubernetes")  # resources.<backend>: that backend's own settings, ignored by the others
# What a person must give: fields with no usable empty value (model.path, data.train_files, reward.function and
# storage.uri are the inputs `verlflow validate-blueprint` checks first). A section holding one is required too.
REQUIRED = {"Blueprint": ("name",), "ModelSpec": ("path",), "DataSpec": ("train_files",), "RewardSpec": ("function",),
            "StorageSpec": ("uri",), "RewardModelSpec": ("path",), "KubernetesSpec": ("image",),
            "PhaseDataSpec": ("train_files",)}
# Prefect's form renders descriptions as markdown, where runs/<run_id>/ holds an HTML tag that vanishes: as code.
PLACEHOLDER = re.compile(r"(?<!`)<[A-Za-z_][\w.-]*>(?!`)")


def run_form(bp: Blueprint, d: RunnerDeployment) -> RunnerDeployment:
    """The deployment's run form (its parameter schema) as a person fills it in: of resources.slurm/kubernetes only
    the section of a backend the blueprint uses (the others stay in the parameters, allowed but not shown), the
    required fields marked required, placeholders in the help shown."""
    schema = d._parameter_openapi_schema.model_dump_for_openapi()
    defs = schema["definitions"]
    used = {bp.resources.backend} | {ph.resources.backend for ph in bp.phases}
    _hide(defs["ResourcesSpec"], [b for b in BACKENDS if b not in used])
    for name, fields in REQUIRED.items():
        defs[name]["required"] = list(fields)
    _require_sections(schema)
    _code_placeholders(schema)
    d._parameter_openapi_schema = ParameterSchema.model_validate(schema)
    return d


def _hide(definition: dict, names: list[str]) -> None:
    """Out of the form, still allowed (additionalProperties is false): the parameters carry the blueprint's values."""
    for n in names:
        definition["properties"].pop(n)
    if names:
        definition.setdefault("patternProperties", {})[f"^({'|'.join(names)})$"] = {}


def _require_sections(schema: dict) -> None:
    """A section ($ref) that holds a required field is required in its parent, up to the flow's parameter, so the
    form marks none of them "(Optional)". Optional sections (set/none) stay optional."""
    defs = schema["definitions"]
    changed = True
    while changed:
        changed = False
        for holder in (schema, *defs.values()):
            for key, prop in holder.get("properties", {}).items():
                target = defs.get(prop.get("$ref", "").removeprefix("#/definitions/"), {})
                if target.get("required") and key not in holder.get("required", []):
                    holder.setdefault("required", []).append(key)
                    changed = True


def _code_placeholders(node) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                node[key] = PLACEHOLDER.sub(r"`\g<0>`", value)
            else:
                _code_placeholders(value)
    elif isinstance(node, list):
        for item in node:
            _code_placeholders(item)


def finetune_deployment(bp: Blueprint, name: str | None = None, cron: str | None = None, **kw) -> RunnerDeployment:
    """Each scheduled run gets its own flow run id, hence its own run id (no full cache hit between runs); with
    schedule.init_from=previous it warm-starts from the blueprint's last promoted policy, and the runs take turns
    (a concurrency limit of one run that queues the others: flows/common.py, TURNS)."""
    cron = cron or bp.schedule.cron
    return run_form(bp, finetune.to_deployment(
        name or bp.name, parameters={"blueprint": bp.model_dump(mode="json")},
        schedules=[Cron(cron, timezone=bp.schedule.timezone, slug=BLUEPRINT_SCHEDULE)] if cron else None,
        concurrency_limit=turn_limit(bp),
        description=f"Fine-tune {bp.name}: {bp.algorithm.adv_estimator}, {bp.iterations} iterations, "
                    f"{bp.resources.world_size} x {bp.resources.device}", tags=["verlflow", bp.name], **kw))


def keep_other_schedules(d: RunnerDeployment) -> RunnerDeployment:
    """Registering a deployment replaces its schedules with the ones it carries (the blueprint's cron), which
    dropped schedules added since in the UI or through the API: carry those too. A schedule is the
    blueprint's if it has our slug, or (made before the slug existed) the same cron; a UI pause of it is kept."""
    with get_client(sync_client=True) as client:
        try:
            existing = client.read_deployment_by_name(d.full_name)
        except ObjectNotFound:
            return d
        ours = list(d.schedules or [])

        def owned(s) -> bool:
            return s.slug == BLUEPRINT_SCHEDULE or (s.slug is None and any(s.schedule == o.schedule for o in ours))

        paused = [s.schedule for s in existing.schedules if owned(s) and not s.active]
        ours = [o.model_copy(update={"active": False}) if o.schedule in paused else o for o in ours]
        others = [DeploymentScheduleCreate(schedule=s.schedule, active=s.active, parameters=s.parameters,
                                           max_scheduled_runs=s.max_scheduled_runs, slug=s.slug)
                  for s in existing.schedules if not owned(s)]
        if not ours:  # the blueprint dropped its cron: an update with slugs alone would keep the old one
            for s in existing.schedules:
                if owned(s):
                    client.delete_deployment_schedule(existing.id, s.id)
        if ours or others:
            d.schedules = ours + others
    return d


def validate_deployment(bp: Blueprint, name: str | None = None, **kw) -> RunnerDeployment:
    return run_form(bp, validate.to_deployment(name or bp.name, parameters={"blueprint": bp.model_dump(mode="json")},
                                               tags=["verlflow", bp.name], **kw))


def ensure_process_pool(pool: str) -> None:
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(
                name=pool, type="process", base_job_template=ProcessWorker.get_default_base_job_template()))


def deploy(bp: Blueprint, name: str | None = None, cron: str | None = None, pool: str = "verlflow") -> str:
    """Create or update the deployment `finetune/<name>` on a process work pool; returns its id. The worker
    imports `verlflow.flows.finetune` (the project installed in its environment), so no code is uploaded."""
    try:
        ensure_process_pool(pool)
        d = finetune_deployment(bp, name, cron, work_pool_name=pool, entrypoint_type=EntrypointType.MODULE_PATH)
        return str(keep_other_schedules(d).apply())
    except (DeploymentApplyError, PrefectHTTPStatusError, httpx.HTTPError) as e:
        reason = str(e).splitlines()[0].split(" - For more information")[0]
        raise PrefectServerError(
            f"the Prefect server at {PREFECT_API_URL.value()} did not take deployment finetune/{name or bp.name} "
            f"(after the Prefect client's {PREFECT_CLIENT_MAX_RETRIES.value()} retries): {reason}. A server on "
            "SQLite answers 503 while its database is busy (many flow runs at once): run the command again, or run "
            "the server on PostgreSQL (infra/OPERATIONS.md).") from e


def serve(bps: list[Blueprint], cron: str | None = None, limit: int | None = None) -> None:
    """Serve `finetune/<name>` and `validate/<name>` for each blueprint until interrupted (Ctrl-C / SIGTERM).
    Registering them sets their parameters, description and the blueprint's schedule; schedules added in the UI
    are kept."""
    from prefect import serve as prefect_serve

    deployments = []
    for bp in bps:
        deployments += [keep_other_schedules(finetune_deployment(bp, cron=cron, paused=False)),
                        keep_other_schedules(validate_deployment(bp, paused=False))]
    prefect_serve(*deployments, limit=limit)
