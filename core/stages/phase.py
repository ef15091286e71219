"""What the sft and dpo stage workers share: the epoch, the policy they continue and the checkpoint they leave."""

from verlflow.core.blueprint import PhaseSpec
from verlflow.core.ml import checkpoint
from verlflow.core.ml.optim import apply_hparams, make_optimizer
from verlflow.core.ml.trainstep import Trainee
from verlflow.core.stages.common import StageContext
from verlflow.core.stages.loads import sharded


def epoch_of(ctx: StageContext) -> int:
    """`<phase>.<epoch>` -> epoch (1-based)."""
    return int(str(ctx.iteration).rsplit(".", 1)[1])


def field_of(ph: PhaseSpec, name: str) -> str:
    """How an error names a field of this phase."""
    return f"phase '{ph.label}' ({ph.kind}) {name}"


def load_policy(ctx: StageContext, build, epoch: int) -> tuple[Trainee, dict]:
    """The FSDP policy from the `policy` input, with the phase's optimizer. A phase's first epoch starts a fresh
    optimizer (the moments of another phase's loss do not carry over); later epochs continue this phase's."""
    prev = ctx.input("policy") / "policy"
    a = ctx.phase.algorithm
    model = sharded(ctx, build / "hf_meta", adapters=True, packed=a.use_remove_padding)
    opt = make_optimizer(model, a.optim)
    checkpoint.load(prev, model, opt if epoch > 1 else None, base=build / "ref")
    apply_hparams(opt, a.optim)
    state = checkpoint.read_state(prev)
    step = state["step"] if epoch > 1 else 0
    return Trainee(model, opt), {**state, "step": step}


def save_policy(ctx: StageContext, policy: Trainee, state: dict, history: list[dict], epoch: int) -> dict:
    ph = ctx.phase
    new = {**state, "role": "policy", "step": history[-1]["step"] if history else state["step"], "data_cursor": 0,
           "phase": ph.label, "phase_kind": ph.kind, "epoch": epoch}
    checkpoint.save(ctx.out / "policy", policy.model, policy.optimizer, new, ctx.write)
    return new
