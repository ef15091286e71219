"""Promotion: the atomic `latest` pointers of a run and of its blueprint (retention: verlflow.core.store.retention)."""

import logging

from verlflow.core.blueprint import Blueprint
from verlflow.core.job import JobSpec
from verlflow.core.store.artifacts import ArtifactStore

log = logging.getLogger("verlflow.promote")


def promote(store: ArtifactStore, bp: Blueprint, job: JobSpec, manifest: dict) -> dict:
    run_id, it = job.run_id, job.iteration
    pointer = {
        "run_id": run_id, "iteration": it, "blueprint": bp.name,
        "checkpoint": job.output, "update": job.inputs["update"], "build": job.inputs["build"],
        "hf_uri": store.uri(job.output + "/hf"), "metrics": manifest.get("metrics", {}),
        "lineage": manifest.get("lineage", []),
    }
    store.set_pointer(f"runs/{run_id}/latest", pointer)
    store.set_pointer(f"blueprints/{bp.name}/latest", pointer)
    log.info("promoted %s iteration %s -> %s", run_id, it, pointer["hf_uri"])
    return pointer
