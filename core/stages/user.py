"""user: a phase's own stage class (core/userstage.py's contract) as a stage worker.

Iteration `<phase>`. Inputs: the names the class lists (build, policy, rollout, earlier phases). Output: what the
class writes under ctx.out, each of its declared `outputs` checked before the commit.
"""

from verlflow.core import userstage
from verlflow.core.errors import InputError
from verlflow.core.stages.common import StageContext, stage_main


def run(ctx: StageContext) -> dict:
    ph = ctx.phase
    cls = userstage.load(ph.kind, f"phase '{ph.label}' kind")
    metrics = cls(dict(ph.options)).run(ctx) or {}
    if not isinstance(metrics, dict):
        raise InputError(f"{ph.kind}.run() returned {type(metrics).__name__}; return a dict of metrics.")
    if ctx.is_main():
        missing = [o for o in cls.outputs if not (ctx.out / o).exists()]
        if missing:
            raise InputError(f"{ph.kind} declares outputs {list(cls.outputs)} but did not write {missing} under "
                             "ctx.out; write them (on rank 0) or drop them from `outputs`.")
    return metrics


main = stage_main(run)

if __name__ == "__main__":
    main()
