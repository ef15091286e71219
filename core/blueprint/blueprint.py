"""The root `Blueprint`: its sections, the rules that weigh several of them, a phase's projection, the schedule
(which iterations export and evaluate) and the section hashes that stage keys are made of."""

import hashlib
import json
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from verlflow.core import algos
from verlflow.core.blueprint.sections import (AlgorithmSpec, DataSpec, EvalSpec, FSDPSpec, ModelSpec, PhaseSpec,
                                               PromoteSpec, ResourcesSpec, RewardSpec, RolloutSpec, ScheduleSpec,
                                               Section, StorageSpec, TrackingSpec)
from verlflow.core.errors import BlueprintError


class Blueprint(Section):
    model_config = ConfigDict(title="blueprint")

    name: str = Field("tiny-grpo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="Names the run ids, deployments and the blueprint's promoted-policy pointer.")
    model: ModelSpec = Field(ModelSpec(), description="The policy to fine-tune.")
    data: DataSpec = Field(DataSpec(), description="The prompts.")
    reward: RewardSpec = Field(RewardSpec(), description="How a response is scored.")
    algorithm: AlgorithmSpec = Field(AlgorithmSpec(), description="Advantages, losses and the optimizer (verl "
                                     "core_algos).")
    rollout: RolloutSpec = Field(RolloutSpec(), description="Sampling of the responses.")
    fsdp: FSDPSpec = Field(FSDPSpec(), description="How the model is sharded and computed in training.")
    resources: ResourcesSpec = Field(ResourcesSpec(), description="Where and on what the stage jobs run.")
    storage: StorageSpec = Field(StorageSpec(), description="The artifact store.")
    schedule: ScheduleSpec = Field(ScheduleSpec(), description="Recurring fine-tunes (verlflow serve / deploy).")
    eval: EvalSpec = Field(EvalSpec(), description="Held-out evaluation before and during training.")
    promote: PromoteSpec = Field(PromoteSpec(), description="Which exported policy the latest pointers move to.")
    tracking: TrackingSpec = Field(TrackingSpec(), description="Experiment tracking (MLflow, TensorBoard, W&B).")
    iterations: int = Field(2, ge=1, description="rollout -> update -> checkpoint rounds.")
    seed: int = Field(0, description="Seeds prompt order, sampling and initialisation.")
    deterministic: bool = Field(False, description="Deterministic kernels (slower); for exact reproducibility.")
    phases: list[PhaseSpec] = Field([], description="Optional: phases run in order (sft, dpo, rl, evaluate), each "
                                    "from the previous one's policy. Empty: one rl phase (validate -> build -> "
                                    "(rollout -> update -> checkpoint) x iterations).")

    @model_validator(mode="after")
    def _batches_fit_world(self):
        world, ranks = self.resources.world_size, "resources.nnodes x nproc_per_node"
        a, r, d = self.algorithm, self.rollout, self.data
        problems = []
        if r.async_ is not None:  # the update's ranks take its mini-batches; the rollout's share its samples
            rollout_world, world = r.async_.split(self.resources.nproc_per_node)
            if min(rollout_world, world) < 1:
                return self  # an empty side: _async_rollout_fits says so
            ranks = "the update's: resources.nproc_per_node - rollout.async.devices"
            if (d.batch_size * r.n) % rollout_world:
                problems.append(f"data.batch_size x rollout.n = {d.batch_size * r.n} must divide across the "
                                f"rollout's {rollout_world} ranks (rollout.async.devices)")
        if d.batch_size % a.ppo_mini_batch_size:
            problems.append(
                f"algorithm.ppo_mini_batch_size={a.ppo_mini_batch_size} must divide data.batch_size={d.batch_size}"
            )
        mini_samples = a.ppo_mini_batch_size * r.n
        if mini_samples % world:
            problems.append(
                f"algorithm.ppo_mini_batch_size x rollout.n = {mini_samples} samples must divide across "
                f"{world} ranks ({ranks})"
            )
        elif (mini_samples // world) % a.ppo_micro_batch_size_per_gpu:
            problems.append(
                f"algorithm.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu} must divide the "
                f"{mini_samples // world} samples each rank gets per mini-batch"
            )
        if (d.batch_size * r.n) % world:
            problems.append(f"data.batch_size x rollout.n = {d.batch_size * r.n} must divide across {world} ranks")
        ob = self.reward.overlong_buffer
        if ob.enable and ob.len > r.max_new_tokens:
            problems.append(f"reward.overlong_buffer.len = {ob.len} must be at most rollout.max_new_tokens = "
                            f"{r.max_new_tokens} (the penalty starts len tokens before the limit)")
        if a.adv_estimator in algos.GROUP_ESTIMATORS and r.n < 2:
            problems.append(f"algorithm.adv_estimator={a.adv_estimator} needs rollout.n >= 2 (it compares samples "
                            "of a prompt)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _rollout_logprobs_are_old_logprobs(self):
        """The rollout's log-probs are log_softmax(logits / temperature) of the sampled token, the quantity the
        update recomputes; top-k / top-p sample from a truncated distribution whose log-probs are not that."""
        r, a = self.rollout, self.algorithm
        if (a.old_logprobs == "rollout" or a.rollout_correction) and (r.top_p < 1.0 or r.top_k > 0):
            field, fix = (("algorithm.old_logprobs=rollout", "algorithm.old_logprobs=recompute")
                          if a.old_logprobs == "rollout" else
                          ("algorithm.rollout_correction", "algorithm.rollout_correction=false"))
            raise ValueError(
                f"{field} needs untruncated sampling, got rollout.top_p={r.top_p} and rollout.top_k={r.top_k}: set "
                f"rollout.top_p=1.0 and rollout.top_k=0, or {fix}")
        return self

    @model_validator(mode="after")
    def _fp8_rollout_is_served_and_corrected(self):
        """rollout.weights=fp8 (or auto, which may pick it) and rollout.kv_cache=fp8: the static engine's (the fp8
        weights bf16 on CUDA), and the update told it samples another model."""
        r, a = self.rollout, self.algorithm
        for field in [f for f in ("weights", "kv_cache") if getattr(r, f) in ("fp8", "auto")]:
            value = getattr(r, field)
            if r.engine != "static":
                raise ValueError(f"rollout.{field}={value} is the static engine's: set rollout.engine=static, or "
                                 f"rollout.{field}=model")
            if a.old_logprobs == "recompute" and not a.rollout_correction:
                raise ValueError(
                    f"rollout.{field}={value} {'samples' if value == 'fp8' else 'may sample'} from an fp8 model, not "
                    f"the policy the update recomputes its old "
                    f"log-probs with: set algorithm.rollout_correction=true (importance-weighted against the "
                    f"rollout's own log-probs), or algorithm.old_logprobs=rollout (the PPO ratio against them)")
        if r.weights == "fp8" and self.resources.device == "cuda" and self.fsdp.mixed_precision != "bf16":
            raise ValueError(f"rollout.weights=fp8 on CUDA samples from a bf16 model (the fp8 matmul writes bf16), "
                             f"and fsdp.mixed_precision={self.fsdp.mixed_precision} makes the inference copy "
                             f"{self.fsdp.mixed_precision}: set fsdp.mixed_precision=bf16, or rollout.weights=model")
        return self

    @model_validator(mode="after")
    def _async_rollout_fits(self):
        """rollout.async: two lanes of one local node, and an update that corrects for the older policy that
        sampled (refused, not set: the loss is the user's to choose, and it is part of the update's key)."""
        r, a, res = self.rollout, self.algorithm, self.resources
        if r.async_ is None:
            return self
        rollout_ranks, update_ranks = r.async_.split(res.nproc_per_node)
        if rollout_ranks < 1 or update_ranks < 1:
            raise ValueError(f"rollout.async splits resources.nproc_per_node={res.nproc_per_node} ranks between the "
                             f"rollout and the update, got rollout.async.devices={rollout_ranks}: give each at least "
                             "one (nproc_per_node >= 2, devices below it)")
        if res.backend != "local" or res.nnodes > 1:
            raise ValueError(f"rollout.async runs the rollout and the update side by side on one local node (got "
                             f"resources.backend={res.backend}, nnodes={res.nnodes}): use backend local with nnodes 1, "
                             "or drop rollout.async")
        if self.phases:
            raise ValueError("rollout.async is for a blueprint without phases (its rollout -> update iterations); "
                             "drop rollout.async or the phases")
        if not a.rollout_correction and a.policy_loss != "bypass_mode":
            raise ValueError(
                f"rollout.async.staleness={r.async_.staleness}: a rollout samples from a policy {r.async_.staleness} "
                "update(s) older than the one the update trains, so the update must correct for it: set "
                "algorithm.rollout_correction=true (with algorithm.old_logprobs=recompute: the truncated importance "
                "ratio of the current policy to the sampling one), or algorithm.policy_loss=bypass_mode with "
                "algorithm.old_logprobs=rollout (the PPO ratio against the sampling policy, with truncated "
                "importance weights)")
        return self

    @model_validator(mode="after")
    def _agent_has_room(self):
        """A trajectory holds its prompt and at least one model token within rollout.agent.max_total_tokens; the
        evaluation's turns are capped as the rollout's are. (Whether the environment exists is a check,
        core/checks/agent.py: the blueprint imports no environment.)"""
        agent, longest = self.rollout.agent, self.data.max_prompt_length
        if agent is None:
            return self
        if agent.max_total_tokens <= longest:
            raise ValueError(f"rollout.agent.max_total_tokens={agent.max_total_tokens} leaves no room for a model "
                             f"turn after a prompt of data.max_prompt_length={longest} tokens: raise "
                             f"max_total_tokens above {longest} (prompt + every turn and tool result)")
        if self.eval.max_new_tokens is not None and self.eval.max_new_tokens > agent.max_total_tokens:
            raise ValueError(f"eval.max_new_tokens={self.eval.max_new_tokens} (one turn's cap in agent mode) is "
                             f"above rollout.agent.max_total_tokens={agent.max_total_tokens}: lower it")
        return self

    @model_validator(mode="after")
    def _fused_backend_fits(self):
        a = self.algorithm
        if a.fused_kernels_backend == "triton" and not a.use_fused_kernels:
            raise ValueError("algorithm.fused_kernels_backend=triton is the backend of the fused head: set "
                             "algorithm.use_fused_kernels=true, or fused_kernels_backend=torch")
        if a.fused_kernels_backend == "triton" and self.resources.device != "cuda":
            raise ValueError(f"algorithm.fused_kernels_backend=triton runs verl's Triton kernels, which need CUDA; "
                             f"resources.device is {self.resources.device}: set algorithm.fused_kernels_backend=torch")
        return self

    @model_validator(mode="after")
    def _promotion_has_its_metric(self):
        """A metric of the eval stage decides promotion only where every export has an evaluation of its policy, and
        the start policy has one (evaluate[0]: the score a run must beat to promote anything)."""
        metric, ev, st = self.promote.metric, self.eval, self.storage
        if metric is None or not metric.startswith("eval/"):
            return self
        if not ev.files:
            raise ValueError(f"promote.metric={metric} is an evaluation metric, but eval.files is empty: give held-out "
                             "parquet files in eval.files, or promote by a rollout/ or update/ metric")
        if st.export_every % ev.every:
            raise ValueError(f"promote.metric={metric} needs an evaluation at every export, but storage.export_every="
                             f"{st.export_every} is not a multiple of eval.every={ev.every}: set eval.every to "
                             f"{st.export_every} or a divisor of it")
        if not ev.before_train and (not self.phases or any(ph.kind == "rl" for ph in self.phases)):
            raise ValueError(f"promote.metric={metric} is an evaluation metric, and a run promotes a policy only if "
                             "it beats the start policy's evaluation (the base model's or the warm start's), but "
                             "eval.before_train is false, so the start is not evaluated: set eval.before_train: true "
                             "(the default), or promote by a rollout/ or update/ metric")
        return self

    @model_validator(mode="after")
    def _phases_form_a_chain(self):
        """Every phase starts from the model or an earlier phase; names are unique; one rl phase (the top-level
        sections are its own); each phase's batches fit its ranks."""
        problems, seen = [], {}
        for i, ph in enumerate(self.phases):
            where = f"phases[{i}]"
            if ph.label in seen:
                problems.append(f"{where}.name: '{ph.label}' is already phases[{seen[ph.label]}]'s name; give each "
                                "phase a unique name")
            src = ph.init_from
            if src is not None and src != "model" and src not in seen:
                later = [j for j, q in enumerate(self.phases) if q.label == src]
                why = ("is this phase itself: a phase cannot start from its own output" if later == [i] else
                       f"is phases[{later[0]}], which runs later: a phase starts from an earlier one" if later else
                       "names no phase")
                problems.append(f"{where}.init_from: '{src}' {why}; use 'model' or one of "
                                f"{sorted(seen) or ['(no earlier phase)']}")
            seen.setdefault(ph.label, i)
            if ph.user:
                problems += _user_stage_problems(ph, where, set(seen) - {ph.label},
                                                 any(q.kind == "rl" for q in self.phases[:i]))
            if ph.kind == "evaluate" and not self.eval.files:
                problems.append(f"{where}: an evaluate phase needs eval.files (held-out prompts)")
            try:
                world = ph.resources.over(self.resources).world_size
            except ValueError as e:
                problems.append(f"{where}.resources: {_plain(e)}")
                continue
            if (self.resources.backend == "local" and self.resources.nnodes > 1
                    and ph.resources.over(self.resources).backend != "local"):
                problems.append(f"{where}.resources.backend: a run of node agents (backend local, nnodes="
                                f"{self.resources.nnodes}) runs every phase on its nodes; start the blueprint from "
                                "one driver (nnodes 1 at the top level) to move a phase to slurm/kubernetes")
            a = ph.algorithm
            if ph.kind in ("sft", "dpo") and (a.mini_batch_size % world or (a.mini_batch_size // world)
                                              % a.micro_batch_size_per_gpu):
                problems.append(f"{where}.algorithm: mini_batch_size={a.mini_batch_size} must split into {world} "
                                f"ranks x a multiple of micro_batch_size_per_gpu={a.micro_batch_size_per_gpu}")
        rl = [i for i, ph in enumerate(self.phases) if ph.kind == "rl"]
        if len(rl) > 1:
            problems.append(f"phases[{rl[1]}]: a second rl phase (phases{rl}); one rl phase per blueprint (the top-level algorithm, rollout, data and "
                            "reward are its settings); split the others into blueprints of their own")
        if problems:
            raise ValueError("\n".join(problems))
        for i in rl:  # its batch rules again, at the phase's own ranks
            ph = self.phases[i]
            if ph.resources.nproc_per_node or ph.iterations:
                try:
                    self.phase_blueprint(i)._batches_fit_world()
                except ValueError as e:
                    raise ValueError(f"phases[{i}] (rl, at its resources): {e}") from None
        return self

    def phase_blueprint(self, i: int) -> "Blueprint":
        """The blueprint a phase's steps run with: the top-level one, its resources changed by the phase's (and an
        rl phase's iterations). Which phase a step runs travels beside it (the plan's Step.phase, JobSpec.phase):
        the maths reads that phase's own sections. The result must stay a valid blueprint: a job file holds it."""
        ph = self.phases[i]
        update: dict[str, Any] = {"resources": ph.resources.over(self.resources)}
        if ph.kind == "rl" and ph.iterations:
            update["iterations"] = ph.iterations
        return self.model_copy(update=update)

    @property
    def phase_inputs(self) -> list[dict]:
        """What validate checks of each phase (its kind, dataset, row limit and mini-batch): part of validate's key,
        so a changed phase dataset is checked again while a changed dpo beta is not."""
        return [{"kind": ph.kind, "data": _dump(ph.data), "max_length": ph.algorithm.max_length,
                 "mini_batch_size": ph.algorithm.mini_batch_size} for ph in self.phases]

    def optimizer_steps(self) -> int:
        """Policy optimizer steps of the whole run: the length the learning-rate schedule spans."""
        a = self.algorithm
        return self.iterations * a.ppo_epochs * (self.data.batch_size // a.ppo_mini_batch_size)

    # -- the schedule: which iterations export and evaluate (the plan and the validators read it here) ----------
    def exports_at(self, iteration: int) -> bool:
        """Whether iteration has an export step (HF export, promotion): every storage.export_every, and the last."""
        return iteration % self.storage.export_every == 0 or iteration == self.iterations

    def evaluates_at(self, iteration: int) -> bool:
        """Whether the policy of `iteration` (0: the initial one) is evaluated: eval.before_train for 0, then every
        eval.every iterations and the last."""
        if not self.eval.files:
            return False
        if iteration == 0:
            return self.eval.before_train
        return iteration % self.eval.every == 0 or iteration == self.iterations

    # -- hashing: a stage key depends on the sections it reads, not on the whole file ---------------
    def section_hash(self, *names: str, phase: Optional[int] = None) -> str:
        """Hash of the named sections or single fields ("algorithm.adv_estimator"); "phase" is phases[phase], the
        one phase a step runs (its steps hash that phase alone: a change to another leaves their keys alone)."""
        if "phase" in names and phase is None:
            raise ValueError("section_hash: 'phase' is the step's phase, but no phase was given")
        data = {n: _dump(self.phases[phase] if n == "phase" else _field(self, n)) for n in names}
        for n, fields in _UNKEYED.items():
            for f in fields if n in data else ():
                *outer, last = f.split(".")
                _inner(data[n], outer).pop(last, None)
        if "rollout" in data and data["rollout"].get("async") is None:  # on-policy keys as before rollout.async
            data["rollout"].pop("async", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def _plain(e: ValueError) -> str:
    """A nested model's validation error as its messages alone (pydantic's own form repeats types and URLs)."""
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, x['loc'])) + ': ' if x['loc'] else ''}"
                         f"{x['msg'].removeprefix('Value error, ')}" for x in e.errors())
    return str(e)


def _user_stage_problems(ph: PhaseSpec, where: str, earlier: set[str], after_rl: bool) -> list[str]:
    """A user stage's class imports, and each input it lists is one the plan can give it."""
    from verlflow.core import userstage

    try:
        cls = userstage.load(ph.kind, f"{where}.kind")
    except BlueprintError as e:
        return [str(e)]
    known = {"build", "policy"} | ({"rollout"} if after_rl else set()) | earlier
    bad = [n for n in cls.inputs if n not in known]
    return [f"{where}.kind: {ph.kind} reads input(s) {bad}, which no earlier phase gives; it can read "
            f"{sorted(known)} here{'' if after_rl else ' (rollout: after an rl phase)'}"] if bad else []


# Not part of any stage key: what differs between the agents of one job (each node passes its own), and how the
# node's ranks are split between an async rollout and the update (a checkpoint reshards).
_UNKEYED = {"resources": ("node_rank",), "rollout": ("async.devices",)}


def _inner(d: dict, path: list[str]) -> dict:
    """The dict at `path` in a section's dump ({} where a part is missing or None)."""
    for part in path:
        d = d.get(part) or {}
    return d


def _field(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _dump(v: Any) -> Any:
    if isinstance(v, list):  # phases
        return [_dump(x) for x in v]
    return v.model_dump(mode="json") if isinstance(v, BaseModel) else v
