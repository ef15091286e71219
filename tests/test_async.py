"""rollout.async: one pipeline on 4 CPU ranks split 2/2 (gloo). rollout[i+1] samples update[i-1]'s policy on the
rollout's ranks while update[i] trains on the others; the update weighs its loss by the truncated importance ratio.
(The plan's wiring, the keys and the refusals: tests/test_plan.py.)"""

import pytest
from tinybp import tiny_blueprint

from verlflow.core.orchestrate.pipeline import run_pipeline

pytestmark = pytest.mark.stages


def _span(manifest: dict) -> tuple[float, float]:
    """When the stage's worker ran: its start and end, wall clock (its manifest's timings)."""
    t = manifest["timings"]
    return t["started_at"], t["started_at"] + t["stage_s"]


def test_async_rollouts_overlap_the_update_sample_the_policy_they_claim_and_are_corrected(tiny_kit, tmp_path):
    bp = tiny_blueprint(tiny_kit, tmp_path, "rollout.async.staleness=1", "algorithm.rollout_correction=true",
                        resources__nproc_per_node=4, iterations=3, storage__export_every=3)
    done = {f"{s.stage}[{s.iteration}]": r.manifest
            for s, r in zip(_steps(bp), run_pipeline(bp, "a", on_line=lambda line: None))}

    # rollout[2] ran while update[1] trained, each on its own two ranks. (rollout[3] waits for update[1]'s
    # background commit, which update[2] takes from memory: at these tiny sizes the two may just miss each other.)
    (r0, r1), (u0, u1) = _span(done["rollout[2]"]), _span(done["update[1]"])
    t = min(r0, u0)
    assert max(r0, u0) < min(r1, u1), (f"rollout[2] ran {r0 - t:.2f}-{r1 - t:.2f} s, "
                                       f"update[1] {u0 - t:.2f}-{u1 - t:.2f} s")
    assert {done[n]["world_size"] for n in done if n[:-3] in ("rollout", "update")} == {2}

    # lineage: each rollout names the policy it sampled, one update older than the one its update trains
    sampled = {i: done[f"rollout[{i}]"]["inputs"]["policy"]["stage"] for i in (1, 2, 3)}
    assert sampled == {1: "runs/a/init/build", 2: "runs/a/init/build", 3: "runs/a/1/update"}
    assert done["rollout[3]"]["inputs"]["policy"]["key"] == done["update[1]"]["key"]
    assert done["update[3]"]["inputs"]["policy"]["stage"] == "runs/a/2/update"

    # the correction: on-policy update[1] weighs every sequence 1; update[2] and [3] trained a newer policy than
    # the one that sampled, and their weights say so
    corr = {i: {k: v for k, v in done[f"update[{i}]"]["metrics"].items() if k.startswith("rollout_corr/")}
            for i in (1, 2, 3)}
    assert all(corr.values()), corr
    assert corr[1]["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(corr[i]["rollout_corr/kl"] > 1e-6 for i in (2, 3)), corr

    # every step committed: a rerun reuses them all
    again = run_pipeline(bp, "a", on_line=lambda line: None)
    assert all(r.skipped for r in again)


def _steps(bp):
    from verlflow.core.orchestrate.pipeline import plan

    return plan(bp, "a")
