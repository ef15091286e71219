"""The blueprint's sections: one pydantic model each, with the rules of its own fields (the rules that weigh several
sections are the root `Blueprint`'s, core/blueprint/blueprint.py).

Pydantic models with `extra="forbid"`; their JSON Schema is the Prefect run form. Plain defaults (not
default_factory) so the form shows them. Paths in a blueprint *file* are relative to that file.
"""

from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from verlflow.core import algos
from verlflow.core.stagespec import PHASE_KINDS
from verlflow.core.uris import carries_credentials, root_problem

ADV_ESTIMATORS = tuple(algos.ADV_ESTIMATORS)
POLICY_LOSSES = tuple(algos.POLICY_LOSSES)
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def _readable_optionals(schema: dict, cls) -> None:
    """The run form shows an optional field as a toggle between its anyOf branches, labelled by their titles (else
    by type names such as `str`/`None`): label them for what they mean."""
    for prop in schema.get("properties", {}).values():
        branches = prop.get("anyOf", [])
        if len(branches) == 2 and {"type": "null"} in branches:
            for b in branches:
                b.setdefault("title", "none" if b == {"type": "null"} else "set")


# A flow parameter that may be left empty, shown by the run form as a set/none toggle like the sections' fields.
OptionalText = Union[Annotated[str, WithJsonSchema({"type": "string", "title": "set"})],
                     Annotated[None, WithJsonSchema({"type": "null", "title": "none"})]]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              json_schema_extra=_readable_optionals)


class LoraSpec(Section):
    model_config = ConfigDict(title="lora")

    rank: int = Field(8, ge=1, description="LoRA rank r of every adapter (the low-rank update B @ A).")
    alpha: float = Field(16.0, gt=0.0, description="LoRA alpha: the update is scaled by alpha / rank.")
    target_modules: list[str] = Field(
        ["all-linear"], min_length=1, description="Linear layers that get adapters, by name suffix (q_proj, v_proj, "
        "...), or all-linear (every linear layer of the decoder, not the output head).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input while training.")


class ModelSpec(Section):
    model_config = ConfigDict(title="model")

    path: str = Field("tiny/qwen2/model", description="Hugging Face model folder (config, weights, tokenizer).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the weights are loaded in; training keeps fp32 master weights when float32."
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernels of the HF model (flash_attention_2 needs CUDA and flash-attn).")
    trust_remote_code: bool = Field(
        False, description="Run Python code shipped in the model folder (custom architectures); only for models "
        "you trust.")
    lora: Optional[LoraSpec] = Field(
        None, description="Train LoRA adapters (PEFT) instead of every weight: the optimizer and the update's "
        "checkpoints hold the adapters only, the reference is the base model with adapters off.")


class DataSpec(Section):
    model_config = ConfigDict(title="data")

    train_files: list[str] = Field(
        ["tiny/qwen2/data/train.parquet"],
        min_length=1,
        description="Parquet files in verl's RL schema: prompt (chat messages), data_source, reward_model.ground_truth.",
    )
    prompt_key: str = Field("prompt", description="Column of the parquet files holding each prompt's chat messages.")
    max_prompt_length: int = Field(128, ge=1, description="Prompt tokens after the chat template; longer is an error.")
    batch_size: int = Field(8, ge=1, description="Prompts per iteration (each sampled rollout.n times).")
    shuffle: bool = Field(True, description="Visit the prompts in a seeded random order, reshuffled every epoch; "
                          "false: file order.")


class OverlongBufferSpec(Section):
    model_config = ConfigDict(title="overlong_buffer")

    enable: bool = Field(False, description="Penalise responses that run into the last `len` tokens of "
                         "rollout.max_new_tokens: reward + min(0, -(length - (max_new_tokens - len)) / len x "
                         "penalty_factor), as verl's DAPO reward manager.")
    len: int = Field(4, ge=1, description="Tokens before rollout.max_new_tokens where the penalty starts.")
    penalty_factor: float = Field(1.0, ge=0.0, description="Penalty at rollout.max_new_tokens (linear from 0).")


class RewardModelSpec(Section):
    model_config = ConfigDict(title="reward_model")

    path: str = Field("", description="HF folder of a *ForSequenceClassification model with one label, scored on "
                      "the prompt (chat template) + response in the rollout stage. A local folder.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Its compute dtype.")
    micro_batch_size: int = Field(16, ge=1, description="Samples per forward pass of the reward model.")
    max_length: int = Field(2048, ge=8, description="Tokens of prompt + response it reads at most (truncated).")

    @model_validator(mode="after")
    def _local(self):
        if not self.path:
            raise ValueError("reward.model.path is required with reward.model: the reward model's HF folder")
        if "://" in self.path:
            raise ValueError(f"reward.model.path={self.path}: the reward model must be a local folder (copy it to "
                             "the machines that run the rollout)")
        return self


class RewardCombineSpec(Section):
    model_config = ConfigDict(title="combine")

    function: float = Field(1.0, ge=0.0, description="Weight of reward.function's score (0: not computed).")
    model: float = Field(1.0, ge=0.0, description="Weight of reward.model's score.")


class RewardSpec(Section):
    model_config = ConfigDict(title="reward")

    function: str = Field(
        "tiny_digits",
        description="Reward function from the registry: verl_default (verl's default_compute_score by data_source), "
        "tiny_digits, exact_match, a name registered by reward.module, or 'package.module:function'.",
    )
    module: Optional[str] = Field(None, description="Module imported first; it may call @register_reward('name').")
    batched: bool = Field(False, description="reward.function takes lists (data_sources, solution_strs, "
                          "ground_truths, extra_infos) and returns a list of scores: one call per "
                          "rollout.micro_batch_size samples instead of one per sample.")
    model: Optional[RewardModelSpec] = Field(None, description="A reward model scored beside (or instead of) "
                                             "reward.function.")
    combine: RewardCombineSpec = Field(RewardCombineSpec(), description="The sample's reward: combine.function x "
                                       "the function's score + combine.model x the reward model's.")
    overlong_buffer: OverlongBufferSpec = Field(
        OverlongBufferSpec(), description="DAPO's soft overlong punishment (verl's reward_model.overlong_buffer).")

    @model_validator(mode="after")
    def _something_scores(self):
        if self.combine.function == 0 and (self.model is None or self.combine.model == 0):
            raise ValueError("reward.combine gives weight 0 to everything: keep reward.combine.function > 0, or set "
                             "reward.model with reward.combine.model > 0")
        return self

    @property
    def uses_function(self) -> bool:
        return self.combine.function > 0

    @property
    def uses_model(self) -> bool:
        return self.model is not None and self.combine.model > 0


class FilterGroupsSpec(Section):
    model_config = ConfigDict(title="filter_groups")

    enable: bool = Field(False, description="Drop groups whose samples all got the same reward (no advantage, "
                         "no gradient) and sample more prompts until the batch holds data.batch_size informative "
                         "groups.")
    metric: Literal["score"] = Field("score", description="What must differ within a group: the reward.")
    max_num_gen_batches: int = Field(
        10, ge=1, description="Sampling rounds (of data.batch_size prompts each) per iteration at most; if they do "
        "not find enough informative groups, the batch is filled with uniform ones (counted in the rollout's "
        "metrics) rather than failing the run.")


@dataclass(frozen=True)
class OptimSpec:
    """One trained model's AdamW, gradient clip and learning-rate schedule (verl's optim semantics): what
    core/ml/optim.py, schedule.py and trainstep.py read. Not a YAML section: `AlgorithmSpec.optim`,
    `.critic_optim` and `SupervisedSpec.optim` gather it from their flat fields."""
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    grad_clip: float
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = 0  # -1: lr_warmup_steps_ratio x the run's optimizer steps
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5


class AlgorithmSpec(Section):
    model_config = ConfigDict(title="algorithm")

    adv_estimator: Literal[ADV_ESTIMATORS] = Field(
        "grpo", description="verl core_algos advantage estimator: " + "; ".join(
            f"{k}: {v}" for k, v in algos.ADV_ESTIMATORS.items()) + ".")
    policy_loss: Literal[POLICY_LOSSES] = Field(
        "vanilla", description="verl core_algos policy loss: " + "; ".join(
            f"{k}: {v}" for k, v in algos.POLICY_LOSSES.items()) + ".")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        Field("token-mean", description="How token losses become one number (verl agg_loss): mean over all tokens, "
              "or per sequence first (sum or mean of its tokens), then mean over sequences.")
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount of later token rewards (gae, "
                         "reinforce_plus_plus); 1 = none.")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda (adv_estimator gae): 1 = Monte-Carlo returns, "
                       "lower trusts the critic more.")
    norm_adv_by_std_in_grpo: bool = Field(
        True, description="grpo: divide each sample's advantage by its group's reward std (false: subtract the mean "
        "only, as Dr. GRPO).")
    clip_ratio_low: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip: the probability ratio is kept above "
                                  "1 - clip_ratio_low.")
    clip_ratio_high: float = Field(0.2, gt=0.0, description="PPO clip: the probability ratio is kept below "
                                   "1 + clip_ratio_high (above clip_ratio_low: DAPO's clip-higher).")
    clip_ratio_c: float = Field(3.0, gt=1.0, description="Dual-clip lower bound for negative advantages.")
    use_kl_loss: bool = Field(True, description="KL to the reference policy as a loss term (GRPO style).")
    kl_loss_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = Field(
        "low_var_kl", description="KL estimator of the KL loss (verl kl_penalty names; low_var_kl = k3, clamped).")
    kl_loss_coef: float = Field(0.001, ge=0.0, description="Weight of the KL loss (with use_kl_loss).")
    use_kl_in_reward: bool = Field(False, description="Subtract kl_coef * KL(policy||ref) from token rewards.")
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = Field(
        "kl", description="KL estimator subtracted from the token rewards (with use_kl_in_reward).")
    kl_coef: float = Field(0.001, ge=0.0, description="Weight of the KL in the reward (with use_kl_in_reward).")
    entropy_coeff: float = Field(0.0, ge=0.0, description="Entropy bonus weight (0: none).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over the iteration's batch in the update.")
    old_logprobs: Literal["recompute", "rollout"] = Field(
        "recompute", description="Old log-probs of the PPO ratio: recompute them with the FSDP policy in update, or "
        "take the rollout's (scored by the inference copy that sampled; saves a forward pass of the batch).")
    ppo_mini_batch_size: int = Field(4, ge=1, description="Prompts per optimizer step (x rollout.n samples).")
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1, description="Samples per forward/backward on one rank.")
    use_remove_padding: bool = Field(
        False, description="Padding-free update: each micro-batch's samples packed into one row with variable-length "
        "causal attention (flash varlen on CUDA); micro-batches are filled to ppo_max_token_len_per_gpu tokens "
        "and balanced across ranks by tokens. No FLOP goes to padding.")
    ppo_max_token_len_per_gpu: Optional[Union[Literal["auto"], Annotated[int, Field(ge=1)]]] = Field(
        None, description="With use_remove_padding: real tokens per micro-batch on one rank (default: "
        "ppo_micro_batch_size_per_gpu x the longest sample of the batch). auto: the largest that fits the GPU with "
        "headroom, by the memory plan validate prints (core/orchestrate/memplan.py), 32k at most.")
    log_prob_max_token_len_per_gpu: Optional[int] = Field(
        None, ge=1, description="With use_remove_padding: tokens per forward-only micro-batch (old and reference "
        "log-probs, values); default twice ppo_max_token_len_per_gpu, since no activations are kept.")
    use_fused_kernels: bool = Field(
        False, description="Policy log-probs and entropies from the hidden states a chunk of tokens at a time "
        "(verl's FusedLinearForPPO), never holding fp32 logits over the whole vocabulary: less memory, so bigger "
        "token budgets fit. Same maths; the chunk's logits are recomputed in the backward.")
    fused_kernels_backend: Literal["torch", "triton"] = Field(
        "torch", description="With use_fused_kernels: torch (verl's FusedLinearForPPO: chunks of fp32 logits) or "
        "triton (verl's linear_cross_entropy kernels, fp32 logits never leave the chip; CUDA only, hidden size a "
        "multiple of 128). verl's actor.fused_kernel_options.impl_backend.")
    lr: float = Field(1e-6, gt=0.0, description="AdamW learning rate of the policy.")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay (policy and critic).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas (policy and critic).")
    grad_clip: float = Field(1.0, gt=0.0, description="Gradient norm clip per optimizer step; a non-finite norm "
                             "fails the stage.")
    critic_lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate of the critic (adv_estimator gae).")
    cliprange_value: float = Field(0.5, gt=0.0, description="Value clip of the critic loss (adv_estimator gae).")
    vf_coef: float = Field(0.5, gt=0.0, description="Weight of the critic's value loss (adv_estimator gae).")
    # -- the policy losses' own knobs (verl's ActorConfig.policy_loss defaults) --------------------------------
    clip_cov_ratio: float = Field(0.0002, gt=0.0, le=1.0, description="policy_loss clip_cov: fraction of tokens "
                                  "(by advantage-logp covariance) whose gradient is cut.")
    clip_cov_lb: float = Field(1.0, description="policy_loss clip_cov: lower covariance bound of the tokens cut.")
    clip_cov_ub: float = Field(5.0, description="policy_loss clip_cov: upper covariance bound of the tokens cut.")
    kl_cov_ratio: float = Field(0.0002, gt=0.0, le=1.0, description="policy_loss kl_cov: fraction of tokens "
                                "(largest covariance) given a KL penalty.")
    ppo_kl_coef: float = Field(0.1, ge=0.0, description="policy_loss kl_cov: weight of that KL penalty.")
    dro_beta: Optional[float] = Field(None, gt=0.0, description="policy_loss dro: weight of the quadratic log-ratio "
                                      "penalty (required with dro).")
    tau_pos: float = Field(1.0, gt=0.0, description="policy_loss sapo: gate temperature for positive advantages.")
    tau_neg: float = Field(1.05, gt=0.0, description="policy_loss sapo: gate temperature for negative advantages.")
    bypass_loss_type: Literal["ppo_clip", "reinforce"] = Field(
        "ppo_clip", description="policy_loss bypass_mode: PPO clip on the rollout ratio, or REINFORCE with "
        "importance weights.")
    rollout_is: Optional[Literal["token", "sequence"]] = Field(
        "sequence", description="policy_loss bypass_mode and rollout_correction: importance weights per token or per "
        "sequence (none: off).")
    rollout_is_threshold: float = Field(2.0, gt=0.0, description="policy_loss bypass_mode and rollout_correction: "
                                        "importance weights are truncated at this value.")
    rollout_is_threshold_lower: Optional[float] = Field(
        None, gt=0.0, description="policy_loss bypass_mode and rollout_correction: with it, weights outside "
        "[rollout_is_threshold_lower, rollout_is_threshold] are zeroed instead of capped (IcePop: the token or "
        "sequence drops out of the loss); none: truncation only.")
    rollout_correction: bool = Field(
        False, description="With old_logprobs=recompute: weight each token's policy loss by the truncated importance "
        "ratio of the recomputed old log-probs to the rollout's own (verl's decoupled rollout correction, per "
        "rollout_is, verl's default sequence, or token, whose weights stay nearer 1 on long responses; capped at "
        "rollout_is_threshold), so that a rollout whose numerics differ from the trained policy "
        "(rollout.weights=fp8, other kernels) is corrected for; update/rollout_corr/* reports the gap. Needs "
        "untruncated sampling.")
    gdpo_reward_weights: Optional[list[float]] = Field(
        None, description="adv_estimator gdpo: weight of each reward component in reward.combine's order "
        "(none: all 1).")
    # -- the learning-rate schedule (verl's optim semantics; the position is the optimizer step count, which the
    # policy checkpoint holds, so a rerun or a world-size change continues it) ------------------------------------
    lr_scheduler_type: Literal["constant", "cosine"] = Field(
        "constant", description="After the warm-up: constant, or cosine down to min_lr_ratio x lr at the last step.")
    lr_warmup_steps: int = Field(-1, ge=-1, description="Optimizer steps of linear warm-up from 0 (-1: "
                                 "lr_warmup_steps_ratio x the run's steps).")
    lr_warmup_steps_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Warm-up as a fraction of the run's "
                                         "optimizer steps (with lr_warmup_steps -1).")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine: the floor, as a fraction of lr.")
    num_cycles: float = Field(0.5, gt=0.0, description="cosine: waves over the run (0.5: one half-cosine down).")
    filter_groups: FilterGroupsSpec = Field(FilterGroupsSpec(), description="DAPO's dynamic sampling.")

    @property
    def optim(self) -> OptimSpec:
        """The policy's optimizer."""
        return OptimSpec(lr=self.lr, betas=self.betas, weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                         lr_scheduler_type=self.lr_scheduler_type, lr_warmup_steps=self.lr_warmup_steps,
                         lr_warmup_steps_ratio=self.lr_warmup_steps_ratio, min_lr_ratio=self.min_lr_ratio,
                         num_cycles=self.num_cycles)

    @property
    def critic_optim(self) -> OptimSpec:
        """The critic's (adv_estimator gae): the policy's at critic_lr."""
        return replace(self.optim, lr=self.critic_lr)

    @property
    def fused_head(self) -> Optional[str]:
        """The fused head's backend (use_fused_kernels), or None: how core/ml/model.wrap_fsdp takes it."""
        return self.fused_kernels_backend if self.use_fused_kernels else None

    @property
    def rollout_is_band(self) -> float | str:
        """verl's rollout_is_threshold: the cap (truncated IS), or "lower_upper" (IcePop: zero outside the band)."""
        if self.rollout_is_threshold_lower is None:
            return self.rollout_is_threshold
        return f"{self.rollout_is_threshold_lower}_{self.rollout_is_threshold}"

    @property
    def greedy_baseline(self) -> bool:
        """The rollout samples a greedy response per prompt as the estimator's baseline (remax); part of the
        rollout's key."""
        return self.adv_estimator in algos.GREEDY_BASELINE

    @model_validator(mode="after")
    def _loss_has_its_inputs(self):
        if self.adv_estimator == "gdpo":
            raise ValueError("algorithm.adv_estimator=gdpo normalises each reward component on its own, but this "
                             "blueprint's reward has no reward components to give it; use grpo")
        if self.policy_loss == "dro" and self.dro_beta is None:
            raise ValueError("algorithm.policy_loss=dro needs algorithm.dro_beta (the weight of its quadratic "
                             "log-ratio penalty), e.g. 0.1")
        if self.rollout_correction and (self.old_logprobs != "recompute" or self.policy_loss == "bypass_mode"):
            raise ValueError("algorithm.rollout_correction weighs the recomputed old log-probs against the rollout's: "
                             "it needs algorithm.old_logprobs=recompute and a policy_loss other than bypass_mode "
                             "(bypass_mode corrects with the rollout's log-probs itself)")
        if self.rollout_is_threshold_lower is not None and self.rollout_is_threshold_lower > self.rollout_is_threshold:
            raise ValueError(f"algorithm.rollout_is_threshold_lower={self.rollout_is_threshold_lower} is above "
                             f"algorithm.rollout_is_threshold={self.rollout_is_threshold}: the kept band "
                             "[lower, threshold] would be empty; lower it below the threshold, e.g. 0.5")
        if self.rollout_correction and self.rollout_is is None:
            raise ValueError("algorithm.rollout_correction needs algorithm.rollout_is (token or sequence): with none "
                             "it would weigh nothing")
        if self.ppo_max_token_len_per_gpu == "auto" and not self.use_remove_padding:
            raise ValueError("algorithm.ppo_max_token_len_per_gpu=auto sizes packed micro-batches: set "
                             "algorithm.use_remove_padding=true, or lower ppo_micro_batch_size_per_gpu instead")
        if self.policy_loss == "bypass_mode" and self.old_logprobs != "rollout":
            raise ValueError("algorithm.policy_loss=bypass_mode uses the rollout's log-probs as the old ones: set "
                             "algorithm.old_logprobs=rollout")
        if self.adv_estimator in algos.SUM_PI_SQUARED:
            if self.old_logprobs != "recompute" or self.use_fused_kernels:
                raise ValueError(
                    f"algorithm.adv_estimator={self.adv_estimator} needs each token's sum of squared probabilities, "
                    "which the update's old log-prob pass computes from the full logits: set "
                    "algorithm.old_logprobs=recompute and algorithm.use_fused_kernels=false")
        return self


class AgentSpec(Section):
    """rollout.mode agent: each sample is a conversation of model turns and environment observations (tool
    results), trained on the model's own tokens only."""
    model_config = ConfigDict(title="agent")

    environment: str = Field(
        "calculator", min_length=1, description="The environment a trajectory talks to: a registered name "
        "(calculator, python, verl_tools, or one registered by rollout.agent.module) or 'package.module:Class'.")
    module: Optional[str] = Field(None, description="Module imported first; it may register environments "
                                  "(@register_environment('name')).")
    config: dict[str, Any] = Field({}, description="Settings handed to the environment's constructor (its own "
                                   "keys).")
    max_turns: int = Field(6, ge=1, le=256, description="Model turns per trajectory at most (each turn is "
                           "rollout.max_new_tokens tokens at most).")
    max_total_tokens: int = Field(2048, ge=2, description="Tokens of prompt + every turn and observation at most; "
                                  "a trajectory that reaches it ends, marked truncated.")
    tool_timeout_s: float = Field(10.0, gt=0.0, le=3600.0, description="Wall-clock seconds of one environment "
                                  "step; past it the call is marked timed out and the trajectory goes on.")
    max_failed_fraction: float = Field(0.1, ge=0.0, le=1.0, description="Share of a stage's trajectories whose "
                                       "environment may raise (each fails alone, its traceback in the stage log); "
                                       "above it the stage fails.")
    tool_config: Optional[str] = Field(None, description="A verl tool config YAML (tools: [{class_name, config, "
                                       "tool_schema}]), read by environment verl_tools.")

    @field_validator("environment")
    @classmethod
    def _names_an_environment(cls, environment: str) -> str:
        """A registered name or 'package.module:Class'; whether it exists is the checks' (core/checks/agent.py):
        the blueprint imports no environment."""
        module, colon, attr = environment.partition(":")
        if environment != environment.strip() or (colon and (not module or not attr or ":" in attr)):
            raise ValueError(f"'{environment}' is neither a registered environment name nor "
                             "'package.module:Class'")
        return environment


class AsyncRolloutSpec(Section):
    """rollout.async: one-step-off rollouts. rollout[i+1] samples from update[i-1]'s policy on its own ranks while
    update[i] trains on the others; the update corrects for the stale policy (algorithm.rollout_correction or
    policy_loss bypass_mode)."""
    model_config = ConfigDict(title="async")

    staleness: int = Field(1, ge=1, description="Updates a rollout's policy lags behind: rollout[i] samples from "
                           "update[i-1-staleness]'s policy (the build's for the first ones). Part of the rollout's "
                           "and the update's keys.")
    devices: Optional[int] = Field(
        None, ge=1, description="Ranks (GPUs on cuda) of the node that serve the rollout; the update, and every other "
        "stage (validate, build, evaluate, export), runs on the other resources.nproc_per_node - devices. None: half "
        "the node. Not part of any key: a checkpoint reshards, so a run may resume at another split.")

    def split(self, nproc: int) -> tuple[int, int]:
        """(the rollout's ranks, the update's) on a node of `nproc` ranks."""
        rollout = self.devices if self.devices is not None else nproc // 2
        return rollout, nproc - rollout


class RolloutSpec(Section):
    model_config = ConfigDict(title="rollout", validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    mode: Literal["single", "agent"] = Field(
        "single", description="single: one response per sample. agent: a multi-turn conversation with "
        "rollout.agent's environment (tool calls and their results); only the model's tokens are trained.")
    agent: Optional[AgentSpec] = Field(None, description="The environment and limits of rollout.mode agent "
                                       "(required there, refused with mode single).")

    async_: Optional[AsyncRolloutSpec] = Field(
        None, alias="async", description="One-step-off asynchronous rollouts: the next rollout samples from an "
        "older policy on its own ranks while the update trains (rollout.async.staleness, .devices). None: on-policy, "
        "every stage on every rank, one after the other.")

    n: int = Field(4, ge=1, description="Samples per prompt (the GRPO group size).")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: sample among the most likely tokens "
                         "holding this probability mass; 1 disables it.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_new_tokens: int = Field(16, ge=1, description="Response tokens generated per sample at most (EOS ends "
                                "one earlier).")
    micro_batch_size: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = Field(
        32, description="Sequences generated together on one rank. auto: as many as fit beside what the warm pool "
        "keeps (the KV cache stays for the update), up to 640 and the rank's samples, by validate's memory plan.")
    engine: Literal["hf", "static"] = Field(
        "hf", description="hf: transformers generate (dynamic cache). static: verlflow.core.ml.fastgen, a static KV cache "
        "with the decode step captured as a CUDA graph (Llama, Qwen2/3, Mistral, Phi-3, Gemma-2/3, OLMo-2; eager on "
        "CPU).")
    batching: Literal["continuous", "micro_batches"] = Field(
        "continuous", description="engine static: continuous: micro_batch_size rows generate at once and a row "
        "whose response ended takes the next waiting prompt (a long response holds one row, not a whole batch); "
        "micro_batches: each micro-batch runs until its longest response ends.")
    weights: Literal["model", "fp8", "auto"] = Field(
        "model", description="engine static: the projections' weights in the model's dtype, or fp8 (e4m3, a scale per "
        "output channel, activations scaled per token; the embedding and LM head stay): half the weight bytes and "
        "the GPU's fp8 matmuls (sm_89 or newer), sampling from a slightly different model, so it needs "
        "algorithm.rollout_correction or algorithm.old_logprobs=rollout. auto: fp8 only where a timed check of the "
        "projections at the engine's rows finds it at least 5% faster on this card (never on a CPU, a GPU without "
        "fp8 or a model not in bf16; kept per machine, agreed by the ranks, rollout/weights_fp8 says which). "
        "Evaluation samples the model's weights.")
    kv_cache: Literal["model", "fp8"] = Field(
        "model", description="engine static: the KV cache in the model's dtype, or fp8 (e4m3, a scale per KV head and "
        "slot): half the cache's bytes, read directly by the Triton decode kernel (sm_89 or newer); every token, the "
        "prompt's too, attends to the rounded keys and values, so it samples from a slightly different model and "
        "needs algorithm.rollout_correction or algorithm.old_logprobs=rollout, as rollout.weights=fp8 does. "
        "Evaluation keeps the model's cache.")

    @model_validator(mode="after")
    def _agent_fits_mode(self):
        if self.mode == "agent" and self.agent is None:
            raise ValueError("rollout.mode=agent needs rollout.agent (at least rollout.agent.environment, e.g. "
                             "calculator)")
        if self.mode == "single" and self.agent is not None:
            raise ValueError("rollout.agent is read in rollout.mode=agent only: set rollout.mode=agent, or drop "
                             "rollout.agent")
        if self.agent is not None and self.agent.max_total_tokens < self.max_new_tokens:
            raise ValueError(f"rollout.agent.max_total_tokens={self.agent.max_total_tokens} is below "
                             f"rollout.max_new_tokens={self.max_new_tokens} (one turn's cap): raise "
                             "max_total_tokens or lower max_new_tokens")
        return self


class FSDPSpec(Section):
    model_config = ConfigDict(title="fsdp")

    version: Literal[1, 2] = Field(2, description="2: fully_shard per decoder layer; 1: FullyShardedDataParallel.")
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = Field(
        "FULL_SHARD", description="FSDP1: what is sharded (params, grads and optimizer state with FULL_SHARD; "
        "HYBRID_SHARD shards within a node and replicates across nodes).")
    use_orig_params: bool = Field(True, description="FSDP1 only.")
    mixed_precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Compute dtype of sharded params.")
    reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description="dtype of the gradient reduce-scatter.")
    cpu_offload: bool = Field(False, description="Keep sharded parameters in host memory between uses (less device "
                              "memory, slower).")
    forward_prefetch: bool = Field(True, description="FSDP1: gather the next unit's parameters during this forward.")
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NONE"] = Field(
        "BACKWARD_PRE", description="FSDP1: when the next unit's parameters are gathered in the backward.")
    reshard_after_forward: bool = Field(True, description="FSDP2: free gathered parameters after each forward "
                                        "(false keeps them until the backward: more memory, fewer all-gathers).")
    wrap_class: Optional[str] = Field(None, description="Decoder-layer class to wrap; default: model._no_split_modules.")
    activation_checkpointing: Union[bool, Literal["auto"]] = Field(
        False, description="Recompute each decoder layer's activations in the backward (less memory, about a third "
        "more compute). auto: off where the update fits without it at a token budget of 16k or more, by validate's "
        "memory plan.")
    compile: bool = Field(False, description="torch.compile each decoder layer's forward (update stage; the first "
                          "steps pay the compile, cached in TORCHINDUCTOR_CACHE_DIR).")
    defer_grad_sync: bool = Field(
        False, description="Reduce-scatter gradients once per mini-batch instead of after every micro-batch "
        "(fewer collectives across GPUs; the unsharded gradients accumulate in the compute dtype meanwhile).")


class SlurmSpec(Section):
    """backend: slurm. Each stage is one sbatch job: one srun task per node running torchrun (c10d)."""

    model_config = ConfigDict(title="slurm (only for backend: slurm)")

    partition: Optional[str] = Field(None, description="#SBATCH --partition (default: the cluster's default).")
    account: Optional[str] = Field(None, description="#SBATCH --account.")
    time_limit: Optional[str] = Field(
        None, description="#SBATCH --time (e.g. '02:00:00'); default: resources.stage_timeout_s rounded up to minutes."
    )
    gpus_per_node: int = Field(0, ge=0, description="#SBATCH --gpus-per-node (0: none asked for).")
    cpus_per_task: Optional[int] = Field(None, ge=1, description="#SBATCH --cpus-per-task (one task per node).")
    extra_sbatch: list[str] = Field(
        [], description="More #SBATCH options, one per entry, e.g. '--qos=high' or '--exclusive'."
    )
    setup: list[str] = Field(
        [], description="Shell lines run on the head node before srun (module load, source a venv...)."
    )
    shared_dir: Optional[str] = Field(
        None, description="A folder every node sees (job files, output, torchrun error files); "
        "default: .verlflow/slurm under the submitting folder."
    )
    python: Optional[str] = Field(None, description="Python on the nodes; default: the submitting interpreter.")
    rdzv_port_base: int = Field(20000, ge=1024, le=65000,
                                description="Rendezvous port = base + job id mod rdzv_port_span (unique per job).")
    rdzv_port_span: int = Field(10000, ge=1, le=40000, description="How many ports the rendezvous port is picked "
                                "from (above rdzv_port_base).")

    @model_validator(mode="after")
    def _port_range(self):
        if self.rdzv_port_base + self.rdzv_port_span > 65536:
            raise ValueError("rdzv_port_base + rdzv_port_span must stay below 65536")
        return self


class KubernetesSpec(Section):
    """backend: kubernetes. Each stage is an indexed batch/v1 Job (one pod per node) plus a headless Service."""

    model_config = ConfigDict(title="kubernetes (only for backend: kubernetes)")

    namespace: str = Field("default", description="Namespace of the Job, Service and ConfigMap.")
    image: Optional[str] = Field(None, description="Container image with verlflow installed (required).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="The pods' imagePullPolicy.")
    service_account: Optional[str] = Field(None, description="serviceAccountName of the pods (empty: the "
                                           "namespace's default).")
    gpus_per_node: int = Field(0, ge=0, description="nvidia.com/gpu limit per pod.")
    cpu: Optional[str] = Field(None, description="CPU request and limit per pod, e.g. '8'.")
    memory: Optional[str] = Field(None, description="Memory request and limit per pod, e.g. '64Gi'.")
    env_from_secret: Optional[str] = Field(
        None, description="Secret whose keys become env vars (e.g. AWS_ACCESS_KEY_ID); secrets never go in a manifest."
    )
    pvc: Optional[str] = Field(None, description="PersistentVolumeClaim mounted at pvc_mount (file:// stores, models).")
    pvc_mount: str = Field("/data", description="Where the pvc is mounted in the pods.")
    cache_dir: Optional[str] = Field(
        None, description="Absolute folder in the pods for compiled kernels (torch.compile, Triton) and the static "
        "engine's timed choices, which a stage's pod reuses from earlier pods. Default: <pvc_mount>/.verlflow-cache "
        "when a pvc is mounted; else the pod's scratch, and every stage's pod compiles again.")
    node_selector: dict[str, str] = Field({}, description="nodeSelector of the pods (label: value).")
    tolerations: list[dict[str, Any]] = Field([], description="Tolerations of the pods, as in a pod spec.")
    labels: dict[str, str] = Field({}, description="Extra labels on the Job and its pods.")
    python: str = Field("python", description="Python in the image.")
    rdzv_port: int = Field(29400, ge=1024, le=65535, description="Port of the c10d rendezvous on pod 0.")
    ttl_seconds_after_finished: int = Field(3600, ge=0, description="Kubernetes deletes a finished Job after this "
                                            "many seconds.")
    context: Optional[str] = Field(None, description="kubeconfig context; default: in-cluster, else the current one.")

    @field_validator("cache_dir")
    @classmethod
    def _absolute_cache_dir(cls, v):
        if v is not None and not v.startswith("/"):
            raise ValueError(f"{v!r} is not an absolute path in the pods; give one like /data/.verlflow-cache")
        return v


class ResourcesSpec(Section):
    model_config = ConfigDict(title="resources")

    backend: Literal["local", "slurm", "kubernetes"] = Field(
        "local", description="Where stage jobs run: local torchrun, sbatch on Slurm, or a Kubernetes Job."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu runs gloo; cuda runs nccl for CUDA tensors and gloo for CPU ones.")
    nnodes: int = Field(1, ge=1, description="Nodes (machines) per stage job.")
    nproc_per_node: int = Field(2, ge=1, description="Ranks per node (one per GPU on cuda).")
    node_rank: int = Field(
        0, ge=0, description="backend local with nnodes > 1: this agent's node (0 runs the store and single-process "
        "stages); start one verlflow per node with the same blueprint and its own node_rank."
    )
    rdzv_endpoint: Optional[str] = Field(
        None, description="backend local with nnodes > 1: host:port of the c10d rendezvous (on node 0)."
    )
    stage_timeout_s: int = Field(
        1800, ge=1, description="A stage job is stopped after this many seconds, every rank's Python stack printed "
        "first (a hang shows where each rank waits); it then fails as TIMEOUT (retryable).")
    retries: int = Field(1, ge=0, description="Retries of a stage whose failure is retryable (timeouts, kills).")
    oom_retry: bool = Field(
        True, description="A training stage (update, sft, dpo) that runs out of device memory runs again once with "
        "its micro-batches at half (the update's ppo_max_token_len_per_gpu, or its ppo_micro_batch_size_per_gpu; a "
        "phase's micro_batch_size_per_gpu), where they can be halved. The maths stay the same (only the sums' order "
        "changes); its metrics record it (oom_retries and the setting it ran with), which then is the one to set. "
        "false: the stage fails with the error, which names that setting.")
    warm_workers: bool = Field(
        False, description="backend local, one node only (refused otherwise): keep one torchrun job alive for a "
        "whole pipeline and run each stage in it (no spawn or imports per stage; each stage still commits its own "
        "artifact). A failed stage ends the pool and the next stage starts a fresh one.")
    async_checkpoint: bool = Field(
        True, description="with warm_workers: the update copies its checkpoint (the export stage its HF export) "
        "to CPU memory and the pool writes, digests and commits it in the background while the next stages run. Commits keep the stages' order (a "
        "stage is never visible before its inputs); the run ends only when every commit has landed. Needs host "
        "memory for one copy of each rank's checkpoint shard (pinned on CUDA).")
    slurm: SlurmSpec = Field(SlurmSpec(), description="Only for backend: slurm (ignored otherwise).")
    kubernetes: KubernetesSpec = Field(KubernetesSpec(), description="Only for backend: kubernetes (ignored "
                                       "otherwise).")

    @model_validator(mode="after")
    def _backend_settings(self):
        problems = []
        if self.node_rank >= self.nnodes:
            problems.append(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        if self.backend == "local" and self.nnodes > 1 and not self.rdzv_endpoint:
            problems.append("backend local with nnodes > 1 needs rdzv_endpoint (host:port on node 0, e.g. "
                            "node0.example:29400); or use backend slurm/kubernetes, which pick it themselves")
        if self.backend != "local" and (self.node_rank or self.rdzv_endpoint):
            problems.append(f"node_rank and rdzv_endpoint are for backend local; backend {self.backend} "
                            "places the nodes and the rendezvous itself")
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                problems.append(f"rdzv_endpoint '{self.rdzv_endpoint}' must be host:port")
        if self.backend == "kubernetes" and not self.kubernetes.image:
            problems.append("backend kubernetes needs kubernetes.image (an image with verlflow installed)")
        if self.warm_workers and (self.backend != "local" or self.nnodes > 1):
            problems.append(f"resources.warm_workers: true is served by backend local on one node only (got "
                            f"resources.backend={self.backend}, resources.nnodes={self.nnodes}); set "
                            "resources.warm_workers: false (each stage is then its own job), or use backend local "
                            "with nnodes 1")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def warm_pool(self) -> bool:
        """Whether stages run in a warm worker pool (verlflow.core.orchestrate.pool): the one rule the runner and the flow's slots follow."""
        return self.warm_workers and self.backend == "local" and self.nnodes == 1

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def dist_backend(self) -> str:
        # NCCL for CUDA tensors, gloo for the CPU ones (metric all-reduces, DCP's and all_gather_object's bytes).
        return "cpu:gloo,cuda:nccl" if self.device == "cuda" else "gloo"


class StorageSpec(Section):
    model_config = ConfigDict(title="storage")

    uri: str = Field("artifacts", description="Artifact root: a folder, file:///abs, or s3://bucket/prefix.")
    endpoint_url: Optional[str] = Field(None, description="S3-compatible endpoint (MinIO...). Keys come from env.")
    region: Optional[str] = Field(None, description="S3 region (empty: the endpoint's or the environment's).")
    keep_last: int = Field(3, ge=1, description="HF exports (export stages) kept, besides the best one and "
                           "any a pointer names.")
    keep_last_checkpoints: int = Field(
        2, ge=1, description="Training checkpoints (DCP policy, optimizer, critic) of the last N updates kept, "
        "besides the best one and any a pointer names; an older one is pruned once a newer one is committed.")
    keep_best_metric: Optional[str] = Field("reward_mean", description="Also keep the export and the training "
                                            "checkpoint best by this metric.")
    export_every: int = Field(1, ge=1, description="HF export and promotion every N iterations, and always at "
                              "the last.")
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of the HF exports; auto: the model folder's own (config.json torch_dtype), "
        "e.g. bf16 for a bf16 model trained with fp32 master weights.")
    export_lora: Literal["merged", "adapter"] = Field(
        "merged", description="model.lora: the HF export is the base with the adapters merged in (a plain model "
        "folder), or the PEFT adapter folder alone (adapter_config.json + adapter_model.safetensors).")

    @field_validator("uri")
    @classmethod
    def _one_place(cls, uri: str) -> str:
        """A file:// or s3:// root without '.', '..' or empty segments (core/uris.py root_problem); a URI
        that carries credentials is missing_inputs' to refuse (an error here would repeat it)."""
        problem = None if carries_credentials(uri) else root_problem(uri)
        if problem:
            raise ValueError(problem)
        return uri


class EvalSpec(Section):
    model_config = ConfigDict(title="eval")

    files: list[str] = Field(
        [], description="Held-out parquet files in verl's RL schema (prompt, data_source, reward_model.ground_truth); "
        "each data_source is reported on its own. Empty: no evaluation.")
    prompt_key: str = Field("prompt", description="Column of the eval files holding each prompt's chat messages.")
    max_prompts: Optional[int] = Field(None, ge=1, description="Prompts evaluated per file at most (its first "
                                       "rows); empty: all of them.")
    n: int = Field(1, ge=1, description="Samples per prompt (pass@k needs n >= k).")
    temperature: float = Field(0.0, ge=0.0, description="0: greedy (then n must be 1); above 0: sampled.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of the eval samples; 1 disables it.")
    max_new_tokens: Optional[int] = Field(None, ge=1, description="Response tokens per sample at most; empty: "
                                          "rollout.max_new_tokens.")
    reward: Optional[str] = Field(None, description="Reward function scoring the eval responses (a registry name "
                                  "or 'package.module:function', reward.module is imported first); empty: "
                                  "reward.function.")
    threshold: float = Field(1.0, description="A sample is correct when its reward is >= threshold (accuracy, "
                             "pass@k).")
    pass_k: list[int] = Field([1], min_length=1, description="pass@k is reported for each of these k (unbiased "
                              "estimator over the n samples of a prompt; each k <= n).")
    before_train: bool = Field(True, description="Evaluate the initial policy before the first iteration.")
    every: int = Field(1, ge=1, description="Evaluate every N iterations, and always at the last.")
    samples_shown: int = Field(3, ge=0, description="Sample responses per data source kept in the report.")

    @model_validator(mode="after")
    def _samples_cover_k(self):
        problems = []
        if bad := [k for k in self.pass_k if k < 1 or k > self.n]:
            problems.append(f"eval.pass_k {bad} must be between 1 and eval.n={self.n}: raise eval.n or drop them")
        if self.n > 1 and self.temperature == 0:
            problems.append(f"eval.n={self.n} greedy samples would all be the same: set eval.temperature > 0 "
                            "(e.g. 0.6) or eval.n=1")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class PromoteSpec(Section):
    model_config = ConfigDict(title="promote")

    metric: Optional[str] = Field(
        None, description="Metric that decides promotion, e.g. eval/openai/gsm8k/accuracy, eval/accuracy (all data "
        "sources), rollout/reward_mean, update/kl_loss. The run's and the blueprint's latest move only to a policy "
        "better than the best so far. Empty: every export is promoted.")
    mode: Literal["max", "min"] = Field("max", description="Whether a higher (max) or lower (min) metric is better.")
    min_delta: float = Field(0.0, ge=0.0, description="How much better than the best so far a policy must be to "
                             "be promoted.")


class TrackingSpec(Section):
    model_config = ConfigDict(title="tracking")

    backends: list[Literal["mlflow", "tensorboard", "wandb"]] = Field(
        ["mlflow"], description="Experiment trackers the run logs its parameters and metrics to (empty: none). "
        "mlflow: a local store under the artifact root unless tracking.mlflow_uri is set.")
    mlflow_uri: Optional[str] = Field(None, description="MLflow tracking server (http://host:5000) or store URI; "
                                      "empty: the embedded local store.")
    experiment: Optional[str] = Field(None, description="MLflow experiment / W&B project; empty: the blueprint's "
                                      "name.")
    wandb_entity: Optional[str] = Field(None, description="W&B entity (team); the API key comes from WANDB_API_KEY "
                                        "in the environment, never from the blueprint.")


class ScheduleSpec(Section):
    model_config = ConfigDict(title="schedule")

    cron: Optional[str] = Field(None, description="Cron expression for recurring fine-tunes (verlflow deploy).")
    timezone: str = Field("UTC", description="IANA timezone of the cron, e.g. Europe/Paris.")
    init_from: Literal["base", "previous"] = Field(
        "base", description="previous: warm-start from the last promoted policy of this deployment."
    )


# ---------------------------------------------------------------------------------------------------
# Phases: sft -> dpo -> rl -> evaluate, declared in one file. The top-level sections are the rl phase's (and the
# defaults every phase inherits); an sft/dpo phase names its own data and optimizer.

DPO_LOSSES = ("sigmoid", "ipo", "hinge")  # verlflow.core.ml.dpo.LOSSES (a test keeps them equal)


class PhaseDataSpec(Section):
    model_config = ConfigDict(title="phase data")

    train_files: list[str] = Field([], description="Parquet files: sft takes `messages` (multi-turn) "
                                   "or `prompt` + `response`; dpo takes `prompt`, `chosen`, `rejected`.")
    shuffle: bool = Field(True, description="Shuffle the rows every epoch (seeded by seed and the epoch).")


class SupervisedSpec(Section):
    """The optimizer and batching of an sft or dpo phase (the rl phase's are the top-level algorithm's)."""
    model_config = ConfigDict(title="phase algorithm")

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate (constant).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip per optimizer step.")
    mini_batch_size: int = Field(8, ge=1, description="Rows (sft conversations, dpo pairs) per optimizer step, "
                                 "across all ranks.")
    micro_batch_size_per_gpu: int = Field(2, ge=1, description="Rows per forward/backward on one rank.")
    max_length: int = Field(1024, ge=8, description="Longest row in tokens (prompt + response); a longer row is "
                            "refused, naming it.")
    use_remove_padding: bool = Field(False, description="Pack each micro-batch padding-free (as the rl update).")
    beta: float = Field(0.1, gt=0, description="dpo: the KL strength of the implicit reward.")
    loss: Literal[DPO_LOSSES] = Field("sigmoid", description="dpo: sigmoid (DPO), ipo or hinge.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo sigmoid loss: conservative DPO's label noise.")

    @property
    def optim(self) -> OptimSpec:
        """The phase's optimizer: a constant learning rate, no warm-up."""
        return OptimSpec(lr=self.lr, betas=self.betas, weight_decay=self.weight_decay, grad_clip=self.grad_clip)


class PhaseResourcesSpec(Section):
    """What a phase changes of the top-level resources (unset: inherited)."""
    model_config = ConfigDict(title="phase resources")

    nproc_per_node: Optional[int] = Field(None, ge=1, description="Ranks per node for this phase's steps.")
    stage_timeout_s: Optional[int] = Field(None, ge=1, description="Seconds one of this phase's steps may run.")
    retries: Optional[int] = Field(None, ge=0, description="Retries of this phase's retryable failures.")
    backend: Optional[Literal["local", "slurm", "kubernetes"]] = Field(
        None, description="Where this phase's stage jobs run (its slurm/kubernetes settings are the top-level ones). "
        "A phase moved off local runs each stage as its own job unless it sets warm_workers itself.")
    nnodes: Optional[int] = Field(None, ge=1, description="Nodes per stage job of this phase (slurm/kubernetes).")
    warm_workers: Optional[bool] = Field(None, description="This phase's resources.warm_workers.")

    def over(self, top: "ResourcesSpec") -> "ResourcesSpec":
        """The top-level resources with this phase's changes, validated as resources are (ValueError)."""
        mine = self.model_dump(exclude_none=True)
        moved = mine.get("backend", top.backend) != "local" or mine.get("nnodes", top.nnodes) > 1
        if moved and "warm_workers" not in mine:
            mine["warm_workers"] = False  # a pool is one local node's; the phase's own choice wins (and is checked)
        if mine.get("backend", "local") != "local":
            mine.update(node_rank=0, rdzv_endpoint=None)  # the scheduler places nodes and the rendezvous itself
        return ResourcesSpec.model_validate({**top.model_dump(), **mine})


class PhaseSpec(Section):
    model_config = ConfigDict(title="phase")

    kind: str = Field("rl", description="sft, dpo, rl (the top-level algorithm/rollout/data/reward), evaluate "
                      "(eval.* on the previous phase's policy), or a user stage `package.module:Class` "
                      "(verlflow.core.userstage).")
    name: Optional[str] = Field(None, pattern=r"^[A-Za-z][A-Za-z0-9_-]*$",
                                description="Unique; names its steps (sft[<name>.1]). Default: the kind.")
    data: Optional[PhaseDataSpec] = Field(None, description="sft/dpo: the phase's dataset (required there).")
    algorithm: SupervisedSpec = Field(SupervisedSpec(), description="sft/dpo: optimizer, batching, dpo's loss.")
    resources: PhaseResourcesSpec = Field(PhaseResourcesSpec(), description="Overrides of the top-level resources.")
    epochs: int = Field(1, ge=1, description="sft/dpo: passes over the data, one committed step each.")
    iterations: Optional[int] = Field(None, ge=1, description="rl: rollout/update rounds (default: the top-level "
                                      "iterations).")
    init_from: Optional[str] = Field(None, description="The policy this phase starts from: `model` (model.path) or "
                                     "an earlier phase's name. Default: the previous phase (the model for the first).")
    options: dict[str, Any] = Field({}, description="A user stage's settings (its `self.options`); part of its key.")

    @property
    def user(self) -> bool:
        """A user stage (`package.module:Class`)."""
        return self.kind not in PHASE_KINDS

    @property
    def label(self) -> str:
        return self.name or self.kind

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        from verlflow.core.userstage import SPEC

        if kind not in PHASE_KINDS and not SPEC.fullmatch(kind):
            raise ValueError(f"'{kind}' is none of {', '.join(PHASE_KINDS)}, nor a user stage "
                             "'package.module:Class'")
        return kind

    @model_validator(mode="after")
    def _fields_fit_kind(self):
        if self.options and not self.user:
            raise ValueError(f"options are a user stage's settings; a {self.kind} phase takes none")
        if self.kind in ("sft", "dpo") and (self.data is None or not self.data.train_files):
            raise ValueError(f"a {self.kind} phase needs data.train_files (its {self.kind} parquet files)")
        if self.kind in ("rl", "evaluate") and self.data is not None:
            raise ValueError(f"a {self.kind} phase takes no data (the rl phase trains on the top-level data; "
                             "evaluate reads eval.files)")
        if self.kind != "rl" and self.iterations is not None:
            raise ValueError(f"iterations is for rl phases; a {self.kind} phase counts epochs")
        return self
