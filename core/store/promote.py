"""Promotion (atomic `latest` pointers) and retention of exported checkpoints."""

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
    prune(store, bp, run_id)
    return pointer


def prune(store: ArtifactStore, bp: Blueprint, run_id: str) -> list[str]:
    """Keep the last `keep_last` exports and the best by `keep_best_metric`; the rest lose their files but keep
    a manifest marked pruned, so a rerun still sees the stage as done."""
    # ls lists files: runs/<run>/<iteration>/checkpoint/manifest.json marks a committed export.
    iterations = {int(parts[2]) for parts in (k.split("/") for k in store.ls(f"runs/{run_id}"))
                  if len(parts) == 5 and parts[2].isdigit() and parts[3] == "checkpoint" and parts[4] == "manifest.json"}
    stages = []
    for it in iterations:
        m = store.read_manifest(f"runs/{run_id}/{it}/checkpoint")
        if m and not m.get("pruned"):
            stages.append((it, m))
    stages.sort(key=lambda x: x[0])
    keep = {it for it, _ in stages[-bp.storage.keep_last:]}
    metric = bp.storage.keep_best_metric
    scored = [(m["metrics"].get(metric), it) for it, m in stages if m["metrics"].get(metric) is not None] if metric else []
    if scored:
        keep.add(max(scored)[1])
    pruned = []
    for it, m in stages:
        if it in keep:
            continue
        key = f"runs/{run_id}/{it}/checkpoint"
        store.mark_pruned(key)
        pruned.append(key)
        log.info("retention: pruned %s", key)
    return pruned
