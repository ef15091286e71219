"""rollout.async: one run of the Prefect flow, as a run from the UI starts it, on 4 CPU ranks split 2/2 (gloo).
rollout[i+1] samples update[i-1]'s policy on the rollout's ranks while update[i] trains on the others; the update
weighs its loss by the truncated importance ratio. (The plan's wiring, the keys and the refusals: tests/test_plan.py.)"""

import datetime as dt

import pytest
from prefect_server import api, manifest
from tinybp import tiny_blueprint

pytestmark = pytest.mark.system


def _span(m: dict) -> tuple[float, float]:
    """When the stage's worker ran: its start and end, wall clock (its manifest's timings)."""
    t = m["timings"]
    return t["started_at"], t["started_at"] + t["stage_s"]


def _task_span(run: dict) -> tuple[dt.datetime, dt.datetime]:
    return dt.datetime.fromisoformat(run["start_time"]), dt.datetime.fromisoformat(run["end_time"])


def _overlap(a: tuple, b: tuple) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def test_async_rollouts_overlap_the_update_sample_the_policy_they_claim_and_are_corrected(prefect_server, tiny_kit,
                                                                                         tmp_path):
    from verlflow.flows.finetune import finetune

    bp = tiny_blueprint(tiny_kit, tmp_path, "rollout.async.staleness=1", "algorithm.rollout_correction=true",
                        resources__nproc_per_node=4, iterations=3, storage__export_every=3)
    state = finetune(blueprint=bp, run_id="a", return_state=True)
    assert state.is_completed(), state.message
    done = {f"{st}[{i}]": manifest(bp, "a", i, st) for i in (1, 2, 3) for st in ("rollout", "update")}
    tasks = {r["name"]: r for r in api(prefect_server, "/task_runs/filter",
                                       {"flow_runs": {"id": {"any_": [str(state.state_details.flow_run_id)]}}})}

    # rollout[2] ran while update[1] trained, each on its own two ranks, and their task runs overlap in the flow run.
    # (rollout[3] waits for update[1]'s background commit, which update[2] takes from memory: at these tiny sizes
    # the two may just miss each other.)
    (r0, r1), (u0, u1) = _span(done["rollout[2]"]), _span(done["update[1]"])
    t = min(r0, u0)
    assert _overlap((r0, r1), (u0, u1)), (f"rollout[2] ran {r0 - t:.2f}-{r1 - t:.2f} s, "
                                          f"update[1] {u0 - t:.2f}-{u1 - t:.2f} s")
    assert _overlap(_task_span(tasks["rollout[2]"]), _task_span(tasks["update[1]"]))
    assert {m["world_size"] for m in done.values()} == {2}

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

    # every step committed: a rerun of the run reuses them all, each task run named Cached
    again = finetune(blueprint=bp, run_id="a", return_state=True)
    assert again.is_completed(), again.message
    reran = api(prefect_server, "/task_runs/filter",
                {"flow_runs": {"id": {"any_": [str(again.state_details.flow_run_id)]}}})
    stages = [r for r in reran if r["name"].split("[")[0] in ("rollout", "update", "export")]
    assert len(stages) == 7 and {r["state_name"] for r in stages} == {"Cached"}, [r["name"] for r in stages]
