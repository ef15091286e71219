"""A real tiny FSDP2 policy on gloo (run under torchrun by tests/test_memplan.py): the bytes this rank holds for its
parameters, gradients and AdamW state after one optimizer step, built and stepped by the update stage's own code
(model.wrap_fsdp, optim.make_optimizer). Prints one JSON line per blueprint (argv: JSON list of override lists).
Then the rollout's bf16 inference copy filled from the trained policy tensor by tensor (checkpoint.copy_full_into)
against the whole state dict loaded into a model of the policy's dtype and cast after: the same tensors."""

import json
import sys

import torch
import torch.distributed as dist

from verlflow.core.blueprint import load_blueprint
from verlflow.core.ml import model as M
from verlflow.core.ml.optim import make_optimizer


def local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def measure(overrides: list[str]) -> dict:
    bp = load_blueprint(None, overrides)
    module = M.build_module(bp.model.path, bp.model, packed=bp.algorithm.use_remove_padding, adapters=True)
    model, _ = M.wrap_fsdp(module, bp.fsdp, torch.device("cpu"), bp.algorithm.fused_head)
    opt = make_optimizer(model, bp.algorithm.optim)
    weights = local_bytes(model.parameters())
    ids = torch.randint(5, 300, (2, 24))
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    trained = [p for p in model.parameters() if p.requires_grad]
    state = [t for p in trained for k, t in opt.state[p].items() if k != "step"]
    return {"weights": weights, "gradients": local_bytes(p.grad for p in trained), "adamw": local_bytes(state),
            "copy_equal": copy_equal(bp, model)}


def copy_equal(bp, model) -> bool:
    from verlflow.core.ml import checkpoint

    whole = M.build_module(bp.model.path, bp.model)
    whole.load_state_dict(checkpoint.full_state_dict(model))
    whole.to(torch.bfloat16)
    streamed = M.build_module(bp.model.path, bp.model.model_copy(update={"dtype": "bfloat16"}))
    checkpoint.copy_full_into(model, streamed)
    a, b = whole.state_dict(), streamed.state_dict()
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    dist.init_process_group("gloo")
    rows = [measure(o) for o in json.loads(sys.argv[1])]
    if dist.get_rank() == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
