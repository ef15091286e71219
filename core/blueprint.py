"""The blueprint: one YAML file that describes a whole post-training run.

Pydantic models with `extra="forbid"`; their JSON Schema is the Prefect run form. Plain defaults (not
default_factory) so the form shows them. Paths in a blueprint *file* are relative to that file.
"""

import difflib
import hashlib
import json
import posixpath
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from verlflow.core import algos
from verlflow.core.errors import BlueprintError

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


class RolloutSpec(Section):
    model_config = ConfigDict(title="rollout")

    n: int = Field(4, ge=1, description="Samples per prompt (the GRPO group size).")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: sample among the most likely tokens "
                         "holding this probability mass; 1 disables it.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_new_tokens: int = Field(16, ge=1, description="Response tokens generated per sample at most (EOS ends "
                                "one earlier).")
    micro_batch_size: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = Field(
        32, description="Sequences generated together on one rank. auto: as many as fit beside what the warm pool "
        "keeps (the KV cache stays for the update), up to 256 and the rank's samples, by validate's memory plan.")
    engine: Literal["hf", "static"] = Field(
        "hf", description="hf: transformers generate (dynamic cache). static: verlflow.core.ml.fastgen, a static KV cache "
        "with the decode step captured as a CUDA graph (Llama, Qwen2/3, Mistral, Phi-3, Gemma-2/3, OLMo-2; eager on "
        "CPU).")
    batching: Literal["continuous", "micro_batches"] = Field(
        "continuous", description="engine static: continuous: micro_batch_size rows generate at once and a row "
        "whose response ended takes the next waiting prompt (a long response holds one row, not a whole batch); "
        "micro_batches: each micro-batch runs until its longest response ends.")
    weights: Literal["model", "fp8"] = Field(
        "model", description="engine static: the projections' weights in the model's dtype, or fp8 (e4m3, a scale per "
        "output channel, activations scaled per token; the embedding and LM head stay): half the weight bytes and "
        "the GPU's fp8 matmuls (sm_89 or newer), sampling from a slightly different model, so it needs "
        "algorithm.rollout_correction or algorithm.old_logprobs=rollout. Evaluation samples the model's weights.")
    kv_cache: Literal["model", "fp8"] = Field(
        "model", description="engine static: the KV cache in the model's dtype, or fp8 (e4m3, a scale per KV head and "
        "slot): half the cache's bytes, read directly by the Triton decode kernel (sm_89 or newer); every token, the "
        "prompt's too, attends to the rounded keys and values, so it samples from a slightly different model and "
        "needs algorithm.rollout_correction or algorithm.old_logprobs=rollout, as rollout.weights=fp8 does. "
        "Evaluation keeps the model's cache.")


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
    warm_workers: bool = Field(
        False, description="backend local, one node only (refused otherwise): keep one torchrun job alive for a "
        "whole pipeline and run each stage in it (no spawn or imports per stage; each stage still commits its own "
        "artifact). A failed stage ends the pool and the next stage starts a fresh one.")
    async_checkpoint: bool = Field(
        True, description="with warm_workers: the update copies its checkpoint (the checkpoint stage its HF export) "
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
    keep_last: int = Field(3, ge=1, description="HF exports (checkpoint stages) kept, besides the best one and "
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
        """A file:// or s3:// root without '.', '..' or empty segments (core/store/artifacts.py root_problem); a URI
        that carries credentials is missing_inputs' to refuse (an error here would repeat it)."""
        from verlflow.core.store.artifacts import carries_credentials, root_problem

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

PHASE_KINDS = ("sft", "dpo", "rl", "evaluate")
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
    # Internal: not in the JSON schema (the run form) nor the allowed keys, and not dumped while unset.
    active_phase: SkipJsonSchema[Optional[int]] = Field(
        None, ge=0, exclude_if=lambda v: v is None, description="Set by verlflow on the blueprint one phase's steps "
        "run with (its index in phases); leave it unset.")

    @model_validator(mode="after")
    def _batches_fit_world(self):
        world = self.resources.world_size
        a, r, d = self.algorithm, self.rollout, self.data
        problems = []
        if d.batch_size % a.ppo_mini_batch_size:
            problems.append(
                f"algorithm.ppo_mini_batch_size={a.ppo_mini_batch_size} must divide data.batch_size={d.batch_size}"
            )
        mini_samples = a.ppo_mini_batch_size * r.n
        if mini_samples % world:
            problems.append(
                f"algorithm.ppo_mini_batch_size x rollout.n = {mini_samples} samples must divide across "
                f"{world} ranks (resources.nnodes x nproc_per_node)"
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
        """rollout.weights=fp8 and rollout.kv_cache=fp8: the static engine's (the fp8 weights bf16 on CUDA), and the
        update told it samples another model."""
        r, a = self.rollout, self.algorithm
        for field in [f for f in ("weights", "kv_cache") if getattr(r, f) == "fp8"]:
            if r.engine != "static":
                raise ValueError(f"rollout.{field}=fp8 is the static engine's: set rollout.engine=static, or "
                                 f"rollout.{field}=model")
            if a.old_logprobs == "recompute" and not a.rollout_correction:
                raise ValueError(
                    f"rollout.{field}=fp8 samples from an fp8 model, not the policy the update recomputes its old "
                    f"log-probs with: set algorithm.rollout_correction=true (importance-weighted against the "
                    f"rollout's own log-probs), or algorithm.old_logprobs=rollout (the PPO ratio against them)")
        if r.weights == "fp8" and self.resources.device == "cuda" and self.fsdp.mixed_precision != "bf16":
            raise ValueError(f"rollout.weights=fp8 on CUDA samples from a bf16 model (the fp8 matmul writes bf16), "
                             f"and fsdp.mixed_precision={self.fsdp.mixed_precision} makes the inference copy "
                             f"{self.fsdp.mixed_precision}: set fsdp.mixed_precision=bf16, or rollout.weights=model")
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
        if self.active_phase is not None and self.active_phase >= len(self.phases):
            problems.append(f"active_phase: {self.active_phase} names no phase (there are {len(self.phases)}); leave "
                            "it unset")
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
        """The blueprint a phase's steps run with: the top-level one, its resources changed by the phase's,
        `active_phase` naming it (its steps hash that phase alone, so a change to another leaves their keys
        alone), and for sft/dpo the phase's optimizer in `algorithm` (where the model, optimizer and packing code
        read it). The result must stay a valid blueprint: a job file holds it."""
        ph = self.phases[i]
        update: dict[str, Any] = {"active_phase": i, "resources": ph.resources.over(self.resources)}
        if ph.kind == "rl" and ph.iterations:
            update["iterations"] = ph.iterations
        if ph.kind in ("sft", "dpo"):  # their log-probs are the model's own: no sampling temperature
            a = ph.algorithm
            update["rollout"] = self.rollout.model_copy(update={"temperature": 1.0})
            update["algorithm"] = self.algorithm.model_copy(update=dict(
                lr=a.lr, weight_decay=a.weight_decay, betas=a.betas, grad_clip=a.grad_clip, lr_scheduler_type="constant",
                use_remove_padding=a.use_remove_padding))
        return self.model_copy(update=update)

    @property
    def phase(self) -> "PhaseSpec | None":
        """In a phase's blueprint (phase_blueprint): that phase (the key section its steps hash)."""
        return None if self.active_phase is None else self.phases[self.active_phase]

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
        """Whether iteration has a checkpoint step (HF export, promotion): every storage.export_every, and the last."""
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
    def section_hash(self, *names: str) -> str:
        """Hash of the named sections or single fields ("algorithm.adv_estimator")."""
        data = {}
        for n in names:
            obj = self
            for part in n.split("."):
                obj = getattr(obj, part)
            data[n] = _dump(obj)
        for n, fields in _PER_AGENT.items():  # the agents of one multi-node job must agree on every key
            for f in fields if n in data else ():
                data[n].pop(f, None)
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


# Fields that differ between the agents of one job (each node passes its own): not part of any stage key.
_PER_AGENT = {"resources": ("node_rank",)}


def _dump(v: Any) -> Any:
    if isinstance(v, list):  # phases
        return [_dump(x) for x in v]
    return v.model_dump(mode="json") if isinstance(v, BaseModel) else v


# ---------------------------------------------------------------------------------------------------
# Loading with errors that point at the YAML line.


def _line_map(root: yaml.Node | None, duplicates: list | None = None) -> dict[tuple, int]:
    """Maps a YAML path (tuple of keys/indices) to its 1-based line, from the composed document (`_parse_yaml`,
    which bounds its expansion). Keys repeated in one mapping (which YAML silently collapses to the last) are
    appended to `duplicates` as (path, first, again)."""
    lines: dict[tuple, int] = {}

    def walk(node, path):
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for k, v in node.value:
                if duplicates is not None and isinstance(k, yaml.ScalarNode):
                    if k.value in seen:
                        duplicates.append((path + (k.value,), seen[k.value], k.start_mark.line + 1))
                    seen.setdefault(k.value, k.start_mark.line + 1)
                lines[path + (k.value,)] = k.start_mark.line + 1
                walk(v, path + (k.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    if root is not None:
        walk(root, ())
    return lines


# What a blueprint may be: a YAML file of a few KB holds a few hundred values. Bounded before anything expands it
# (the line map, json.dumps, pydantic): a few KB of nested aliases (a "billion laughs") would otherwise expand to
# billions of values. A big prompt or dataset belongs in a file the blueprint names.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 20_000


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that stops composing once the document has MAX_YAML_VALUES nodes (the parser reads events
    lazily: a long list is not read to its end)."""

    def __init__(self, text: str, source: str):
        super().__init__(text)
        self.source, self.nodes = source, 0

    def compose_node(self, parent, index):
        self.nodes += 1
        if self.nodes > MAX_YAML_VALUES:
            raise BlueprintError(f"{self.source}:{self.peek_event().start_mark.line + 1}: the YAML holds more than "
                                 f"{MAX_YAML_VALUES:,} values (no more are read); a blueprint holds a few hundred. "
                                 "Keep long lists in the files the blueprint names (data.train_files, eval.files).")
        return super().compose_node(parent, index)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return node.value if isinstance(node, yaml.SequenceNode) else []


def _parse_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """(data, root node) of one YAML document with yaml.safe_load's rules (yaml.YAMLError as it raises them),
    refusing (BlueprintError) a text over MAX_YAML_BYTES or one that expands to over MAX_YAML_VALUES values, aliases
    counted each time they are used, before anything is built from it."""
    if len(text) > MAX_YAML_BYTES:  # characters: at least as many bytes
        raise BlueprintError(f"{source}: {len(text):,} characters of YAML; a blueprint is a few KB and at most "
                             f"{MAX_YAML_BYTES:,} are read. Keep prompts and data in the files it names "
                             "(data.train_files, eval.files).")
    loader = _BoundedLoader(text, source)
    try:
        try:
            root = loader.get_single_node()  # aliases are shared nodes here: nothing is expanded yet
        except RecursionError:
            raise BlueprintError(f"{source}: the YAML is nested too deeply to read; a blueprint nests a few "
                                 "levels (section: field: value).") from None
        _refuse_expansion(root, source)
        return (None if root is None else loader.construct_document(root)), root
    finally:
        loader.dispose()


def _refuse_expansion(root: yaml.Node | None, source: str) -> None:
    """BlueprintError when the document would hold over MAX_YAML_VALUES values with its aliases expanded, or an
    alias inside the value it names (a cycle). Each node's expanded size is computed once, so a bomb costs what
    its text does."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # the nodes whose values are being counted: the path from the root
    aliased = 0
    stack = [(root, False)] if root is not None else []
    while stack:  # depth first, without recursion
        node, counted = stack.pop()
        if counted:
            open_.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(k)] for k in _children(node))
        elif id(node) in open_:
            raise BlueprintError(f"{source}:{node.start_mark.line + 1}: an alias (*name) inside the value it names "
                                 "makes a value that holds itself; a blueprint is a tree: write the value out.")
        elif id(node) in sizes:
            aliased += 1  # reached again: an alias repeats it
        else:
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((k, False) for k in _children(node))
    total = sizes.get(id(root), 0)
    if total <= MAX_YAML_VALUES:
        return
    raise BlueprintError(f"{source}: the YAML would expand to {total:,} values (at most {MAX_YAML_VALUES:,} are read): "
                         f"its aliases (*name) repeat anchored (&name) values {aliased:,} times, nested into one "
                         "another. A blueprint holds a few hundred values: write out what an alias stands for, or "
                         "nest fewer aliases.")


def _allowed(loc: tuple) -> str:
    """What keys are allowed at the model that holds `loc`."""
    model: Any = Blueprint
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return ""
        model = ann
    names = [n for n, f in model.model_fields.items() if not any(isinstance(m, SkipJsonSchema) for m in f.metadata)]
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{hint} Allowed keys here: {', '.join(names)}."


def _yaml_kind(value: Any) -> str:
    kinds = {dict: "a YAML mapping", list: "a YAML list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "an empty value"}
    return kinds.get(type(value), type(value).__name__)


def _path_in(message: str) -> tuple:
    """`phases[1].init_from: ...` -> ("phases", 1, "init_from"): the field a cross-field message starts with."""
    m = re.match(r"([A-Za-z_]+(?:\[\d+\])?(?:\.[A-Za-z_]+(?:\[\d+\])?)*)", message)
    if not m:
        return ()
    return tuple(int(p) if p.isdigit() else p for p in re.findall(r"[A-Za-z_]+|\d+", m.group(1)))


def _line_of(loc: tuple, lines: dict[tuple, int]) -> int | None:
    return next((lines[loc[:i]] for i in range(len(loc), 0, -1) if loc[:i] in lines), None)


def format_validation_error(err: ValidationError, source: str, lines: dict[tuple, int],
                            overridden: dict[tuple, str] | None = None) -> str:
    out = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not loc:  # a cross-field rule: its message names the fields itself (the first one gives the line)
            for part in msg.split("\n"):  # one problem a line (a validator may join several)
                # a phase's problem names its field first (phases[1].init_from): that line; other rules weigh
                # several fields, where one line would mislead
                line = _line_of(_path_in(part), lines) if part.startswith("phases[") else None
                out.append(f"{source}:{line}: {part}" if line else f"{source}: {part}")
            continue
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        line = next((lines[loc[:i]] for i in range(len(loc), -1, -1) if loc[:i] in lines), None)
        where = f"{source}:{line}" if line else source
        # A value that came from a command-line override is reported as that override, not as a file line.
        hit = [p for p in (overridden or {}) if loc[:len(p)] == p or p[:len(loc)] == loc]
        if hit:
            where = f"override '{overridden[max(hit, key=len)]}'"
        if e["type"] == "extra_forbidden":
            msg = f"unknown key '{loc[-1]}'.{_allowed(loc)}"
        elif e["type"] == "model_type":
            msg = f"must be a mapping of fields (key: value lines), not {_yaml_kind(e.get('input'))}." \
                  f"{_allowed(loc + ('',))}"
        elif isinstance(e.get("input"), (dict, list)):
            if e["type"].endswith("_type"):
                quote = "; quote the value if it is text, e.g. 'a: b'" if e["type"] == "string_type" else ""
                msg = f"{msg} (got {_yaml_kind(e['input'])}{quote})"
        elif "input" in e and e["type"] not in ("missing",):
            msg = f"{msg} (got {e['input']!r})"
        out.append(f"{where}: {field}: {msg}")
    return "Blueprint is not valid:\n  " + "\n  ".join(out)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text or text.startswith("="):
        raise BlueprintError(f"override '{text}' must look like section.field=value, e.g. rollout.n=8")
    key, raw = text.split("=", 1)
    if any(not part.strip() for part in key.split(".")):
        raise BlueprintError(f"override '{text}': the key '{key}' has an empty part; write section.field=value, "
                             "e.g. rollout.n=8")
    try:
        value = _parse_yaml(raw, f"override '{text}'")[0] if raw != "" else ""
    except yaml.YAMLError as e:
        raise BlueprintError(f"override '{text}': value is not valid YAML ({getattr(e, 'problem', e)}); quote "
                             "strings with special characters, e.g. model.path='/a b/c'") from None
    return [part.strip() for part in key.split(".")], value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise BlueprintError(f"override '{text}': '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def resolve_paths(bp: Blueprint, base: Path | str) -> Blueprint:
    """Relative paths in a blueprint file are relative to the file's folder: a local folder, or for a blueprint
    read from a URI (s3://bucket/exp/bp.yaml) that URI's folder (model.path: m -> s3://bucket/exp/m)."""

    def fix(p: str) -> str:
        if "://" in p or Path(p).is_absolute():
            return p
        if isinstance(base, str):
            scheme, folder = base.split("://", 1)
            return f"{scheme}://{posixpath.normpath(posixpath.join(folder, p))}"
        return str((base / p).resolve())

    bp.model.path = fix(bp.model.path)
    bp.data.train_files = [fix(p) for p in bp.data.train_files]
    bp.eval.files = [fix(p) for p in bp.eval.files]
    bp.storage.uri = fix(bp.storage.uri)
    if bp.reward.model is not None:
        bp.reward.model.path = fix(bp.reward.model.path)
    for ph in bp.phases:
        if ph.data is not None:
            ph.data.train_files = [fix(p) for p in ph.data.train_files]
    return bp


def _blueprint_text(path: str | Path) -> tuple[str, Path | str]:
    """A blueprint file's text and the folder its relative paths are relative to. `path` is a local file,
    `file://...`, or any other fsspec URI such as s3://bucket/exp/bp.yaml (read in memory: no temp file)."""
    path = str(path).removeprefix("file://")
    if "://" in path:
        from verlflow.core.store.artifacts import carries_credentials

        if carries_credentials(path):  # the URI itself is not repeated: it holds a secret
            raise BlueprintError("the blueprint URI must not carry credentials (s3://key:secret@bucket/bp.yaml); use "
                                 "s3://bucket/bp.yaml and set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the "
                                 "environment (or a Prefect Secret).")
        return _remote_text(path), path.rsplit("/", 1)[0]
    p = Path(path)
    if not p.is_file():
        raise BlueprintError(f"{path}: no such blueprint file. Pass a YAML file, e.g. blueprints/tiny-cpu.yaml.")
    return _decode(path, p.read_bytes()), p.resolve().parent


def _remote_text(uri: str) -> str:
    import fsspec

    try:
        with fsspec.open(uri, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise BlueprintError(f"{uri}: no such blueprint file; check the bucket and key.") from None
    except Exception as e:  # credentials, endpoint, unknown scheme: the library's own words
        raise BlueprintError(f"{uri}: cannot read the blueprint ({type(e).__name__}: {e}); check the URI, and the "
                             "store's credentials and endpoint in the environment (AWS_ACCESS_KEY_ID, "
                             "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL).") from None
    return _decode(uri, raw)


def _decode(source: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BlueprintError(f"{source}: not a UTF-8 text file; a blueprint is a YAML file "
                             "(e.g. blueprints/tiny-cpu.yaml).") from None


def load_blueprint(path: str | Path | None = None, overrides: list[str] = (), data: dict | None = None) -> Blueprint:
    """Blueprint from a YAML file (a path or an fsspec URI such as s3://bucket/bp.yaml) or a dict, with `a.b=value`
    overrides applied."""
    lines: dict[tuple, int] = {}
    source = "<blueprint>"
    base = Path.cwd()
    if path is not None:
        source = str(path)
        text, base = _blueprint_text(path)
        try:
            data, root = _parse_yaml(text, source)
        except yaml.YAMLError as e:
            mark, cmark = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            what = getattr(e, "problem", None) or str(e)
            context = getattr(e, "context", None)
            if context:  # e.g. "while parsing a flow sequence (line 5), expected ',' or ']', but got ..."
                at = f" (line {cmark.line + 1})" if cmark and (not mark or cmark.line != mark.line) else ""
                what = f"{context}{at}, {what}"
            raise BlueprintError(
                f"{where}: not valid YAML: {what}. Only plain YAML is accepted "
                "(no !!python tags); check indentation and quoting."
            ) from None
        duplicates: list = []
        lines = _line_map(root, duplicates)
        if duplicates:
            raise BlueprintError("\n  ".join(
                f"{source}:{again}: {'.'.join(map(str, key))}: duplicate key (first given on line {first}); "
                "YAML would silently keep only the last one: keep one of them." for key, first, again in duplicates))
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise BlueprintError(f"{source}: the top level must be a mapping of sections (model:, data:, ...).")
    # default=str: YAML dates, sets and binary become strings that fail validation with a clear message.
    data = apply_overrides(json.loads(json.dumps(data, default=str)), list(overrides))
    overridden = {}
    for text in overrides:
        overridden[tuple(parse_override(text)[0])] = text
    try:
        bp = Blueprint.model_validate(data)
    except ValidationError as e:
        raise BlueprintError(format_validation_error(e, source, lines, overridden)) from None
    try:
        return resolve_paths(bp, base)
    except ValidationError as e:  # e.g. storage.uri: ../../x relative to s3://bucket/bp.yaml climbs above the bucket
        raise BlueprintError(f"{source}: a path relative to the blueprint's folder ({base}) is not usable once "
                             f"resolved: {_plain(e)}.") from None


def json_schema() -> dict:
    return Blueprint.model_json_schema()


def _lora_problems(bp: Blueprint) -> list[str]:
    """model.lora.target_modules against the model folder's linear layers (its safetensors headers)."""
    from pathlib import Path

    from verlflow.core.orchestrate.footprint import ModelSize

    size = ModelSize.of(Path(bp.model.path))
    if not size.linears:  # pickled weights only: validate's PEFT injection checks them
        return []
    unmatched = size.unmatched_targets(bp.model.lora)
    if not unmatched:
        return []
    return [f"model.lora.target_modules: {', '.join(unmatched)} names no linear layer of {bp.model.path} (its linear "
            f"layers: {', '.join(size.linear_names())}; or all-linear)"]


def missing_inputs(bp: Blueprint) -> list[str]:
    """Files, URIs and names the blueprint refers to that are not usable, each with the fix (cheap: no torch
    or verl import; the datasets are read with pyarrow, the reward function is resolved)."""
    from verlflow.core.errors import VerlflowError
    from verlflow.core.metrics import unknown_metric_problem
    from verlflow.core.ml.data import load_prompts, missing_file_problems
    from verlflow.core.ml.modeldir import model_dir_problems, reward_model_problems
    from verlflow.core.ml.rewards import load_reward
    from verlflow.core.orchestrate import preflight
    from verlflow.core.store.artifacts import carries_credentials
    from verlflow.core.tracking.checks import tracking_problems

    problems = model_dir_problems(bp.model.path) + _engine_problems(bp)
    missing_data = missing_file_problems(bp.data.train_files)
    problems += missing_data
    if not missing_data:
        try:  # columns, types, rows
            prompts = load_prompts(bp.data.train_files, bp.data.prompt_key)
            problems += preflight.batch_size_problems(bp.data.batch_size, len(prompts),
                                                      bp.algorithm.ppo_mini_batch_size)
        except VerlflowError as e:
            problems.append(str(e))
    try:
        load_reward(bp.reward.function, bp.reward.module)
    except VerlflowError as e:
        problems.append(str(e))
    if bp.reward.model is not None:
        problems += reward_model_problems(bp.reward.model.path)
    if bp.model.lora is not None and not model_dir_problems(bp.model.path):
        problems += _lora_problems(bp)
    if unknown := unknown_metric_problem(bp):
        problems.append(unknown)
    problems += [p for p in _eval_problems(bp) if p not in problems]  # a reward.module error once
    problems += _phase_data_problems(bp)
    scheme = bp.storage.uri.split("://", 1)[0] if "://" in bp.storage.uri else "file"
    if scheme not in ("file", "s3"):
        problems.append(f"storage.uri: scheme '{scheme}://' is not supported; use a folder, file:// or s3://bucket/prefix.")
    elif carries_credentials(bp.storage.uri):  # the URI itself is not repeated: it holds a secret
        problems.append("storage.uri: an s3:// URI must not carry credentials (s3://key:secret@bucket); use "
                        "s3://bucket/prefix and set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment "
                        "(or a Prefect Secret).")
    problems += tracking_problems(bp.tracking)
    return problems


def _phase_data_problems(bp: Blueprint) -> list[str]:
    """An sft/dpo phase's files, as its stage reads them (core/ml/phasedata.py: columns, types, every row), and at
    least one mini-batch of rows."""
    from verlflow.core.errors import InputError
    from verlflow.core.ml.phasedata import load_preferences, load_sft_rows

    problems = []
    for i, ph in enumerate(bp.phases):
        if ph.kind not in ("sft", "dpo"):
            continue
        field = f"phases[{i}].data.train_files"
        read = load_sft_rows if ph.kind == "sft" else load_preferences
        try:
            rows = len(read(ph.data.train_files, field))
        except InputError as e:
            problems.append(str(e))
            continue
        mini = ph.algorithm.mini_batch_size
        if rows < mini:
            problems.append(f"{field}: {rows} rows, fewer than phases[{i}].algorithm.mini_batch_size={mini}; lower "
                            "the mini-batch or add rows.")
    return problems


def _eval_problems(bp: Blueprint) -> list[str]:
    """eval.files' files, columns and rows, and eval.reward's function."""
    from verlflow.core.errors import VerlflowError
    from verlflow.core.ml.evaluate import held_out_problems
    from verlflow.core.ml.rewards import load_reward

    problems = held_out_problems(bp.eval)
    if bp.eval.reward:
        try:
            load_reward(bp.eval.reward, bp.reward.module, field="eval.reward")
        except VerlflowError as e:
            problems.append(str(e))
    return problems


def _engine_problems(bp: Blueprint) -> list[str]:
    """What the rollout engine would refuse in a model folder whose config.json reads (model_dir_problems says
    what else is wrong with it)."""
    from verlflow.core.errors import VerlflowError
    from verlflow.core.ml.modeldir import model_config
    from verlflow.core.orchestrate import preflight

    model_dir = Path(bp.model.path)
    try:
        config = model_config(model_dir)
    except (VerlflowError, OSError):
        return []
    return preflight.static_engine_problems(bp.rollout.engine, model_dir, config)
