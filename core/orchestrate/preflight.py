"""Checks of a blueprint's inputs that would otherwise fail only inside a later stage, after earlier ones committed.

Each fact is decided here once, in one of two tiers:

- cheap (no torch, transformers or verl import; `missing_inputs` in core/blueprint.py calls them): the model
  types the rollout engine runs, the dataset's size (the model folder itself: verlflow.core.ml.modeldir). The CLI
  runs them before anything touches the store, and the validate stage runs them again, since a Prefect flow run
  (UI, schedule) starts there.
- `rollout_problems`: needs the tokenizer and calls the reward function, so only the validate stage (a torchrun
  job that loads both anyway) runs it, before build.

Every problem is one line naming the field or file, what was found and the fix.
"""

from pathlib import Path

from verlflow.core.errors import VerlflowError

_REWARD_SAMPLES = 16  # data sources sampled at most (verl_default picks a scorer per source)


def static_engine_problems(engine: str, model_dir: Path, config: dict) -> list[str]:
    """rollout.engine static runs only the model families the engine itself lists."""
    from verlflow.core.ml.fastgen import SUPPORTED_MODEL_TYPES  # the package's init is torch-free

    model_type = config.get("model_type")
    if engine != "static" or model_type in SUPPORTED_MODEL_TYPES:
        return []
    return [f"rollout.engine: static runs model types {', '.join(SUPPORTED_MODEL_TYPES)}, but "
            f"{model_dir / 'config.json'} has model_type {model_type!r}; set rollout.engine: hf (transformers "
            "generate) for this model."]


def batch_size_problems(batch_size: int, n_prompts: int, mini_batch: int) -> list[str]:
    if batch_size <= n_prompts:
        return []
    return [f"data.batch_size={batch_size} is larger than the dataset: data.train_files hold {n_prompts} "
            f"prompt(s); lower data.batch_size to at most {n_prompts} (a multiple of "
            f"algorithm.ppo_mini_batch_size={mini_batch}) or add prompts."]


# ----------------------------------------------------------------------------------------------------- rollout


def rollout_problems(bp, tok, prompts) -> list[str]:
    """What the rollout would refuse: prompts over data.max_prompt_length, a reward that gives no number."""
    return prompt_length_problems(tok, prompts, bp.data.max_prompt_length) + reward_problems(bp, prompts)


def prompt_length_problems(tok, prompts, limit: int) -> list[str]:
    from verlflow.core.ml.generate import prompt_ids

    # The rollout's own encoding, checked here against the limit for every prompt (the rollout stops at the first).
    rows = list(range(len(prompts)))
    lengths = [len(prompt_ids(tok, msgs)) for msgs in prompts.messages]
    over = [i for i in rows if lengths[i] > limit]
    if not over:
        return []
    longest = max(over, key=lengths.__getitem__)
    return [f"data.max_prompt_length={limit}: {len(over)} of {len(prompts)} prompts in data.train_files are longer "
            f"after the chat template; the longest is {lengths[longest]} tokens (dataset row {longest}). Raise "
            f"data.max_prompt_length to {lengths[longest]} or filter the prompts over {limit} tokens out of the "
            "data."]


def reward_problems(bp, prompts) -> list[str]:
    """The reward called as the rollout calls it, once per data source (up to a few), on that source's first
    prompt with its ground truth as the response."""
    from verlflow.core.ml.rewards import load_reward

    reward = load_reward(bp.reward.function, bp.reward.module)
    first_row: dict[str, int] = {}
    for i, source in enumerate(prompts.data_source):
        if len(first_row) == _REWARD_SAMPLES:
            break
        first_row.setdefault(source, i)
    problems = []
    for source, i in first_row.items():
        truth = prompts.ground_truth[i]
        try:
            reward(source, truth, truth, prompts.extra_info[i])
        except Exception as e:  # noqa: BLE001 - whatever it raises, the rollout would raise too
            what = str(e) if isinstance(e, VerlflowError) else f"{type(e).__name__}: {e}"
            problems.append(f"reward.function {bp.reward.function!r}, called on dataset row {i} (data_source "
                            f"{source!r}) with its ground truth {truth!r:.40} as the response: {what} Fix the "
                            "function or pick another reward.function.")
    return problems
