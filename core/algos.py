"""verl 0.9.1's advantage estimators and policy losses by name, and what each needs that a plain GRPO batch lacks.

Driver-side (no torch, no verl import): the blueprint's enums and the validators read these tables. The validate
stage and tests/test_algorithms.py check them against verl's own registries (`core_algos.ADV_ESTIMATOR_REGISTRY`,
`POLICY_LOSS_REGISTRY`), so a verl that adds or drops a name cannot go unnoticed.
"""

# name -> what the update passes it beyond (token rewards, response mask, group index, AlgoConfig)
ADV_ESTIMATORS = {
    "grpo": "group-normalised outcome reward",
    "grpo_vectorized": "grpo, vectorised",
    "grpo_passk": "pass@k: only the best sample of a group gets an advantage",
    "gdpo": "grpo per reward component, summed with weights, then whitened (needs reward components)",
    "rloo": "leave-one-out baseline",
    "rloo_vectorized": "rloo, vectorised",
    "reinforce_plus_plus": "discounted returns, whitened over the batch",
    "reinforce_plus_plus_baseline": "group mean baseline, whitened over the batch",
    "remax": "baseline = the reward of a greedy response to the same prompt (the rollout samples it)",
    "opo": "length-weighted group baseline",
    "gpg": "group mean baseline with GPG's scaling",
    "optimal_token_baseline": "per-token baseline from the path variance (needs sum of squared probabilities)",
    "tir_optimal_token_baseline": "optimal_token_baseline for multi-turn masks",
    "gae": "generalised advantage estimation with a critic (PPO)",
}

POLICY_LOSSES = {
    "vanilla": "PPO clip (dual-clip for negative advantages)",
    "gspo": "sequence-level importance ratio, clipped (GSPO)",
    "sapo": "soft adaptive gate instead of a hard clip (algorithm.tau_pos/tau_neg)",
    "clip_cov": "PPO clip, and the tokens with the largest advantage-logp covariance get no gradient",
    "kl_cov": "a KL penalty on the tokens with the largest covariance (algorithm.kl_cov_ratio, ppo_kl_coef)",
    "gpg": "plain policy gradient, no ratio",
    "geo_mean": "geometric mean of token ratios per sequence, clipped (GMPO)",
    "dro": "direct reward optimisation: a quadratic log-ratio penalty (algorithm.dro_beta)",
    "cispo": "clipped importance-sampling weight, stop-gradient (CISPO)",
    "dppo_tv": "decoupled PPO with a total-variation trust region",
    "dppo_kl": "decoupled PPO with a KL trust region",
    "bypass_mode": "old log-probs are the rollout's (algorithm.old_logprobs=rollout); PPO clip or REINFORCE with "
                   "truncated importance weights",
}

GROUP_ESTIMATORS = {"grpo", "grpo_vectorized", "grpo_passk", "gdpo", "rloo", "rloo_vectorized",
                    "reinforce_plus_plus_baseline", "opo", "gpg", "optimal_token_baseline",
                    "tir_optimal_token_baseline"}  # compare the samples of a prompt: rollout.n >= 2
SUM_PI_SQUARED = {"optimal_token_baseline", "tir_optimal_token_baseline"}  # from the update's old log-prob pass
GREEDY_BASELINE = {"remax"}  # the rollout also samples one greedy response per prompt


def registry_drift() -> list[str]:
    """Where verl's installed registries and these tables disagree (imports verl: rank/validate side only)."""
    from verl.trainer.ppo import core_algos

    problems = []
    for what, ours, theirs in (("advantage estimators", ADV_ESTIMATORS, core_algos.ADV_ESTIMATOR_REGISTRY),
                               ("policy losses", POLICY_LOSSES, core_algos.POLICY_LOSS_REGISTRY)):
        names = {str(getattr(n, "value", n)) for n in theirs}
        if names != set(ours):
            problems.append(f"verl's {what} differ from verlflow's table (core/algos.py): verl has "
                            f"{sorted(names - set(ours))} that verlflow lacks, verlflow has {sorted(set(ours) - names)} "
                            "that verl lacks")
    return problems
