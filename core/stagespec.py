"""One record per stage kind: what the plan wires into it, what its key hashes, what retention keeps for it.

Torch-free and import-free (a leaf: the blueprint, the driver and the ranks all read it). Everything that differs
between stage kinds lives here; the runner, the plan, retention, the code-version hash, the warm pool and the
metric names read `SPECS` and spell no stage name of their own. A new built-in stage is a spec here plus its
worker, `core/stages/<name>.py`; a user stage's spec is made from its class (core/userstage.spec_of).
"""

from __future__ import annotations

from dataclasses import dataclass, field

WORKERS = "verlflow.core.stages"
POOL = f"{WORKERS}.pool"  # a warm pool's serve loop, which runs the stage workers in one torchrun job


@dataclass(frozen=True)
class StageSpec:
    name: str
    inputs: tuple[str, ...] = ()  # the plan must wire each of these
    optional: tuple[str, ...] = ()  # and may wire these
    key_sections: tuple[str, ...] = ()  # the blueprint sections its outputs depend on (its key hashes them)
    lora_sections: tuple[str, ...] = ()  # hashed too when the model is trained with LoRA adapters
    checkpoint_inputs: tuple[str, ...] = ()  # inputs whose DCP training checkpoint it reads (others: their files)
    reads_everything: bool = False  # it needs every file of its inputs, checkpoints included
    holds: str | None = None  # the retention unit its output is: "checkpoint" (DCP) or "export" (HF folder)
    per_epoch: bool = False  # a phase stage run once per epoch, whose output is a policy (sft, dpo)
    phase_kind: bool = False  # a blueprint phase `kind:` of its own (the rl phase is rollout/update iterations)
    steps: frozenset[str] = field(default_factory=frozenset)  # where it runs: "numbered" iterations, "named" ones
    metric_prefix: str | None = None  # its manifest metrics are `<prefix>/<metric>` (core/metrics)
    single_process: bool = False  # needs no process group beyond one rank
    version: int = 1  # bump for a behaviour change the code hash cannot see (core/store/keys)
    worker: str | None = None  # the worker module, when not core/stages/<name>.py

    @property
    def module(self) -> str:
        """The module torchrun runs for this stage."""
        return self.worker or f"{WORKERS}.{self.name}"

    def check_wiring(self, inputs: dict[str, str], where: str) -> None:
        """A plan step's inputs hold every required name and nothing unknown (a planning bug, not a user's)."""
        missing = [n for n in self.inputs if n not in inputs]
        unknown = [n for n in inputs if n not in self.inputs + self.optional]
        if missing or unknown:
            raise AssertionError(f"{where}: {self.name} is wired without {missing} / with unknown inputs {unknown}")


_POLICY = ("build", "policy")
_TRAINING = ("model", "fsdp", "seed", "deterministic")

SPECS: dict[str, StageSpec] = {s.name: s for s in (
    # validate hashes what it checks: the sft/dpo phases' rows too (phase_inputs)
    StageSpec("validate", key_sections=(
        "model", "data", "reward", "rollout", "fsdp", "resources", "storage", "eval.files", "eval.prompt_key",
        "eval.max_prompts", "eval.reward", "algorithm.adv_estimator", "algorithm.policy_loss",
        "algorithm.ppo_mini_batch_size", "algorithm.ppo_micro_batch_size_per_gpu", "phase_inputs")),
    # build: optimizer hyperparameters are re-applied from the blueprint on every load, so only the estimator
    # (whether a critic exists) matters. No stage hashes `resources`: a checkpoint reshards, so a world-size change
    # reuses what was committed and continues.
    StageSpec("build", optional=("warm_start",), checkpoint_inputs=("warm_start",), holds="checkpoint",
              key_sections=(*_TRAINING, "algorithm.adv_estimator")),
    StageSpec("rollout", inputs=_POLICY, checkpoint_inputs=("policy",), steps=frozenset({"numbered"}),
              metric_prefix="rollout", key_sections=(
                  "model", "data", "reward", "rollout", "fsdp.mixed_precision", "seed", "algorithm.filter_groups",
                  "algorithm.greedy_baseline")),
    StageSpec("update", inputs=(*_POLICY, "rollout"), checkpoint_inputs=("policy",), holds="checkpoint",
              steps=frozenset({"numbered"}), metric_prefix="update",
              key_sections=(*_TRAINING, "data", "algorithm", "rollout")),
    # evaluate: what its samples and scores depend on; not eval.before_train/every (which evaluations exist), nor
    # the rollout's own sampling (the eval's replaces it)
    StageSpec("evaluate", inputs=_POLICY, checkpoint_inputs=("policy",), steps=frozenset({"numbered", "named"}),
              phase_kind=True,
              metric_prefix="eval", key_sections=(
                  "model", "reward", "seed", "data.max_prompt_length", "fsdp.mixed_precision", "rollout.engine",
                  "rollout.batching", "rollout.micro_batch_size", "rollout.max_new_tokens", "rollout.mode",
                  "rollout.agent", "eval.files", "eval.prompt_key", "eval.max_prompts", "eval.n", "eval.temperature",
                  "eval.top_p", "eval.max_new_tokens", "eval.reward", "eval.threshold", "eval.pass_k", "eval.samples_shown")),
    # export (HF folder, promotion): only what its bytes depend on; a changed retention or cadence field must not
    # re-export (and so reach for update checkpoints retention has pruned)
    StageSpec("export", inputs=("build", "update"), optional=("rollout", "evaluate"), checkpoint_inputs=("update",),
              holds="export", single_process=True, key_sections=("storage.export_dtype",),
              lora_sections=("storage.export_lora",)),
    # `phase`: the one phase these steps run (its data, epochs, optimizer, loss); not the top-level algorithm,
    # which is the rl phase's: changing it must not rerun these
    StageSpec("sft", inputs=_POLICY, checkpoint_inputs=("policy",), holds="checkpoint", per_epoch=True, phase_kind=True,
              steps=frozenset({"named"}), metric_prefix="sft",
              key_sections=(*_TRAINING, "phase", "algorithm.use_fused_kernels")),
    StageSpec("dpo", inputs=_POLICY, optional=("reference",), checkpoint_inputs=("policy",), holds="checkpoint",
              per_epoch=True, phase_kind=True, steps=frozenset({"named"}), metric_prefix="dpo",
              key_sections=(*_TRAINING, "phase", "algorithm.use_fused_kernels")),
    # a user stage's own inputs come from its class (userstage.spec_of); its key adds the class's source
    StageSpec("user", checkpoint_inputs=("policy",), steps=frozenset({"named"}), metric_prefix="user",
              key_sections=("model", "phase", "seed", "deterministic")),
    # every iteration in one job: the reference for "staged equals monolithic"; its export is in that dtype
    StageSpec("monolithic", inputs=("build",), reads_everything=True, key_sections=(
        "model", "data", "reward", "algorithm", "rollout", "fsdp", "seed", "deterministic", "iterations",
        "storage.export_dtype")),
)}

RENAMED = {"checkpoint": "export"}  # stage names of earlier releases (`--from`, manifests in older stores)


def spec(stage: str) -> StageSpec:
    """The spec of a stage name, an earlier release's name included."""
    return SPECS[RENAMED.get(stage, stage)]


PHASE_KINDS = (*(n for n, s in SPECS.items() if s.phase_kind), "rl")  # what a blueprint phase's `kind:` names


def metric_stages(where: str) -> tuple[str, ...]:
    """The stages with metrics that run at `numbered` iterations or at `named` ones (a phase's steps)."""
    return tuple(s.name for s in SPECS.values() if s.metric_prefix and where in s.steps)
