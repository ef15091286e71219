"""sft: one epoch of supervised fine-tuning of the policy on its phase's conversations (loss on assistant tokens).

Iteration `<phase>.<epoch>`. Inputs: `build` (hf_meta/, ref/), `policy` (policy/: the build's, an earlier phase's,
or this phase's previous epoch). Output: policy/ (DCP with its optimizer, as the update writes it: the next epoch,
the next phase, an rl phase's build and the export stage read it as they read an update's).
"""

import logging

from verlflow.core.ml import model as M, supervised
from verlflow.core.ml.forward import Rows
from verlflow.core.ml.sft import encode_sft, load_sft_rows, sft_loss
from verlflow.core.stages.common import StageContext, retention_pass, stage_main
from verlflow.core.stages.phase import epoch_of, field_of, load_policy, save_policy

log = logging.getLogger("verlflow.sft")


def run(ctx: StageContext) -> dict:
    bp, at, ph = ctx.bp, ctx.placement, ctx.phase
    build, epoch = ctx.input("build"), epoch_of(ctx)
    tok = M.load_tokenizer(build / "hf_meta")
    batch = encode_sft(tok, load_sft_rows(ph.data.train_files, field_of(ph, "data.train_files")),
                       ph.algorithm.max_length, field_of(ph, "algorithm.max_length"))
    with ctx.timed("load_s"):
        policy, state = load_policy(ctx, build, epoch)
    rows, mask = Rows.of(batch), batch["loss_mask"]

    def micro_loss(model, idx, units):
        logp = supervised.rows_forward(model, rows, idx, ph.algorithm, at.device)
        m = mask[idx].to(at.device)
        loss = sft_loss(logp, m, tokens_in_batch=float(mask[units].sum()), dp_size=at.world)
        return loss, {"sft_nll_sum": -(logp.detach() * m).sum(), "sft_tokens": m.sum()}

    plan = supervised.Epoch.of(ph, bp.seed, len(rows.batch["responses"]), epoch, field_of(ph, "data.train_files"))
    with ctx.timed("train_s"):
        history = supervised.train_epoch(ph, policy, plan, micro_loss, at, state["step"],
                                         defer_grad_sync=bp.fsdp.defer_grad_sync,
                                         progress=log.info if ctx.is_main() else None)
    with ctx.timed("save_s"):
        new_state = save_policy(ctx, policy, state, history, epoch)
    losses = [h["sft_loss"] for h in history]
    return {"step": new_state["step"], "epoch": epoch, "rows": len(mask), "sft_loss": losses[-1],
            "sft_loss_first": losses[0], "sft_loss_mean": sum(losses) / len(losses), "steps": history}


main = stage_main(run, retention_pass)  # the phase's older epochs go once this one is committed

if __name__ == "__main__":
    main()
