"""dpo: one epoch of direct preference optimisation of the policy on its phase's pairs.

Iteration `<phase>.<epoch>`. Inputs: `build` (hf_meta/, ref/), `policy` (the phase's start policy at epoch 1, then
the previous epoch's), and from epoch 2 `reference` (epoch 1's output). The reference is the phase's start policy:
epoch 1 scores every pair with it before its first step and keeps those log-probs as reference.safetensors, which
later epochs read instead of holding a second model. Output: policy/ (as an update writes it), reference.safetensors.
"""

import logging

import torch
from safetensors.torch import load_file, save_file

from verlflow.core.errors import InputError
from verlflow.core.ml import model as M, supervised
from verlflow.core.ml.forward import Rows
from verlflow.core.ml.dpo import dpo_loss, encode_pairs, load_preferences, sequence_logps
from verlflow.core.stages.common import StageContext, retention_pass, stage_main
from verlflow.core.stages.phase import epoch_of, field_of, load_policy, save_policy

log = logging.getLogger("verlflow.dpo")
REFERENCE = "reference.safetensors"


def run(ctx: StageContext) -> dict:
    bp, at, ph = ctx.bp, ctx.placement, ctx.phase
    a = ph.algorithm
    build, epoch = ctx.input("build"), epoch_of(ctx)
    tok = M.load_tokenizer(build / "hf_meta")
    batch = encode_pairs(tok, load_preferences(ph.data.train_files, field_of(ph, "data.train_files")),
                         a.max_length, field_of(ph, "algorithm.max_length"))
    with ctx.timed("load_s"):
        policy, state = load_policy(ctx, build, epoch)
    with ctx.timed("ref_s"):
        ref_tokens = _reference(ctx, policy.model, batch, epoch)
    ref = sequence_logps(ref_tokens, batch["response_mask"], a.loss)
    rows, pairs = Rows.of(batch), len(batch["responses"]) // 2

    def micro_loss(model, idx, units):
        r = idx + [p + pairs for p in idx]  # the micro-batch's chosen rows, then their rejected rows
        logp = supervised.rows_forward(model, rows, r, a, at.device)
        seq = sequence_logps(logp, batch["response_mask"][r].to(at.device), a.loss)
        loss, metrics = dpo_loss(seq, ref[r].to(at.device), a.beta, a.loss, a.label_smoothing)
        metrics["dpo_loss"] = loss.detach()
        return loss * len(idx) / len(units) * at.world, {k: v * len(idx) for k, v in metrics.items()}

    plan = supervised.Epoch.of(ph, bp.seed, pairs, epoch, field_of(ph, "data.train_files"))
    with ctx.timed("train_s"):
        history = supervised.train_epoch(ph, policy, plan, micro_loss, at, state["step"],
                                         defer_grad_sync=bp.fsdp.defer_grad_sync,
                                         progress=log.info if ctx.is_main() else None)
    with ctx.timed("save_s"):
        new_state = save_policy(ctx, policy, state, history, epoch)
    last = history[-1]
    return {"step": new_state["step"], "epoch": epoch, "pairs": pairs, "dpo_loss": last["dpo_loss"],
            **{k: last[k] for k in last if k.startswith(("rewards/", "logps/"))},
            "accuracy_first": history[0]["rewards/accuracies"], "steps": history}


def _reference(ctx: StageContext, policy, batch: dict, epoch: int) -> torch.Tensor:
    """Per-token reference log-probs of every row: scored now by the start policy (epoch 1), else read."""
    if epoch == 1:
        ref = supervised.score_rows(policy, batch, ctx.phase.algorithm, ctx.placement)
        if ctx.is_main():
            save_file({"logp": ref.contiguous()}, str(ctx.out / REFERENCE))
        return ref
    ref = load_file(str(ctx.input("reference") / REFERENCE))["logp"]
    if ref.shape != batch["responses"].shape:
        raise InputError(f"{ctx.input('reference') / REFERENCE}: reference log-probs of shape {tuple(ref.shape)}, but "
                         f"the pairs encode to {tuple(batch['responses'].shape)}; the phase's data changed since its "
                         "first epoch: rerun the phase from its first epoch.")
    return ref


main = stage_main(run, retention_pass)  # the phase's older epochs go once this one is committed

if __name__ == "__main__":
    main()
