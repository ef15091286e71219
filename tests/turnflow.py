"""A flow that takes its turn as `finetune` does (flows/common.py: take_turn, TURN_HOOKS) and then holds it for
`hold_s` seconds instead of training: the queue of a deployment's runs tested with many runs, where a training
per run would cost minutes. Deployed by tests/test_schedule.py as `turns/<name>` (module path `turnflow.turns`,
so its worker needs tests/ on PYTHONPATH)."""

import time

from prefect import flow

from verlflow.core.blueprint import Blueprint
from verlflow.flows.common import TURN_HOOKS, take_turn

RECURRING = Blueprint.model_validate({"schedule": {"init_from": "previous"}})


@flow(name="turns", **TURN_HOOKS)
def turns(hold_s: float = 0.0) -> None:
    take_turn(RECURRING)
    time.sleep(hold_s)
