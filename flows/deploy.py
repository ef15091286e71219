"""Deployments of a blueprint: its full object is the default parameters (the UI form shows its values).

`deploy`: a deployment on a process work pool, run by `prefect worker start --pool POOL` (infra/README.md).
`serve`: the embedded single-machine setup; this process polls for the deployments' runs and executes them.
"""

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.exceptions import ObjectNotFound
from prefect.schedules import Cron

from core.blueprint import Blueprint
from flows.finetune import finetune
from flows.validate import validate


def finetune_deployment(bp: Blueprint, name: str | None = None, cron: str | None = None, **kw) -> RunnerDeployment:
    """Each scheduled run gets its own flow run id, hence its own run id (no full cache hit between runs); with
    schedule.init_from=previous it warm-starts from the blueprint's last promoted policy."""
    cron = cron or bp.schedule.cron
    return finetune.to_deployment(
        name or bp.name, parameters={"blueprint": bp.model_dump(mode="json")},
        schedules=[Cron(cron, timezone=bp.schedule.timezone)] if cron else None,
        description=f"Fine-tune {bp.name}: {bp.algorithm.adv_estimator}, {bp.iterations} iterations, "
                    f"{bp.resources.world_size} x {bp.resources.device}", tags=["verlflow", bp.name], **kw)


def validate_deployment(bp: Blueprint, name: str | None = None, **kw) -> RunnerDeployment:
    return validate.to_deployment(name or bp.name, parameters={"blueprint": bp.model_dump(mode="json")},
                                  tags=["verlflow", bp.name], **kw)


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
    imports `flows.finetune` (the project installed in its environment), so no code is uploaded."""
    ensure_process_pool(pool)
    d = finetune_deployment(bp, name, cron, work_pool_name=pool, entrypoint_type=EntrypointType.MODULE_PATH)
    return str(d.apply())


def serve(bps: list[Blueprint], cron: str | None = None, limit: int | None = None) -> None:
    """Serve `finetune/<name>` and `validate/<name>` for each blueprint until interrupted (Ctrl-C / SIGTERM)."""
    from prefect import serve as prefect_serve

    deployments = []
    for bp in bps:
        deployments += [finetune_deployment(bp, cron=cron, paused=False), validate_deployment(bp, paused=False)]
    prefect_serve(*deployments, limit=limit)
