"""Reward functions by name: a small registry.

Every reward function has verl's signature::

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float

(a ``dict`` with a ``"score"`` key is accepted too, as verl's own scorers sometimes return one).

The blueprint names one in ``reward.function``:

- a registered name: the built-ins ``verl_default``, ``tiny_digits``, ``exact_match``, or a name that the
  module in ``reward.module`` registers when imported (``@register_reward("name")``);
- ``package.module:function``: any importable callable with that signature.

``load_reward(function, module)`` resolves either form and returns a *checked* callable: it always returns
a finite Python float, or raises an error that names the reward function.

This module imports nothing heavy: verl (3-6 s to import, and it configures the root logger) is imported
only when ``verl_default`` is first called.
"""

import math
import re
from typing import Any, Callable, Optional

from verlflow.core.errors import BlueprintError, NonFiniteError
from verlflow.core.plugins import check_name, import_user_module, register_into

RewardFn = Callable[..., Any]

_REGISTRY: dict[str, RewardFn] = {}

_HOW_TO_REGISTER = (
    "To add one, either set reward.module: mypkg.rewards (a module on the Python path whose import runs "
    "`from verlflow.core.ml.rewards import register_reward` / `@register_reward(\"my_reward\")` on a function "
    "fn(data_source, solution_str, ground_truth, extra_info=None) -> float) and reward.function: my_reward, "
    "or set reward.function: 'mypkg.rewards:my_function'."
)


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn`` under ``name``. Returns ``fn`` unchanged.

    Re-registering the same function (same module and qualified name, e.g. a module imported twice) is
    fine; taking a name held by another function needs ``overwrite=True``.
    """
    check_name("register_reward", name)

    def deco(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise BlueprintError(f"register_reward({name!r}) must decorate a function, got {fn!r}")
        register_into(_REGISTRY, "register_reward", name, fn, overwrite)
        return fn

    return deco


def reward_names() -> list[str]:
    """The names registered so far, sorted."""
    return sorted(_REGISTRY)


def get_reward(name: str, field: str = "reward.function") -> Callable[..., float]:
    """The registered reward ``name`` as a checked callable (returns a finite float); errors name `field`."""
    fn = _REGISTRY.get(name)
    if fn is None:
        raise BlueprintError(
            f"{field}: unknown reward function {name!r}. Known: {', '.join(reward_names())}. "
            + _HOW_TO_REGISTER
        )
    return _checked(name, fn)


def load_reward(function: str, module: Optional[str] = None, field: str = "reward.function") -> Callable[..., float]:
    """Resolve the blueprint's ``reward.function`` (after importing ``reward.module`` when given); `field`: the
    blueprint field that names `function` (eval.reward), for the errors."""
    if module:
        _import(module, field="reward.module", what=f"reward.module: cannot import {module!r}")
    if not isinstance(function, str) or not function.strip():
        raise BlueprintError(f"{field} must name a reward function, got {function!r}. " + _HOW_TO_REGISTER)
    function = function.strip()
    if ":" not in function:
        return get_reward(function, field)
    mod_name, _, attr = function.partition(":")
    if not mod_name or not attr:
        raise BlueprintError(
            f"{field}: {function!r} is not of the form 'package.module:function'. " + _HOW_TO_REGISTER
        )
    mod = _import(mod_name, field=field, what=f"{field}: cannot import module {mod_name!r}")
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BlueprintError(f"{field}: module {mod_name!r} has no attribute {attr!r} ({function!r}).")
        obj = getattr(obj, part)
    if not callable(obj):
        raise BlueprintError(f"{field}: {function!r} is not callable (it is {type(obj).__name__}).")
    return _checked(function, obj)


def score_all(function: str, module: Optional[str], batched: bool, data_sources: list, solutions: list[str],
              ground_truths: list, extra_infos: list, micro_batch: int) -> list[float]:
    """reward.function's score of each sample: one call per sample, or (reward.batched) one call per `micro_batch`
    samples with lists, returning a list of numbers as long as its inputs."""
    fn = load_reward(function, module)
    if not batched:
        return [fn(d, s, g, e) for d, s, g, e in zip(data_sources, solutions, ground_truths, extra_infos)]
    raw, out = fn.wrapped, []
    for i in range(0, len(solutions), micro_batch):
        part = slice(i, i + micro_batch)
        got = raw(data_sources[part], solutions[part], ground_truths[part], extra_info=extra_infos[part])
        n = len(solutions[part])
        if not isinstance(got, (list, tuple)) or len(got) != n:
            raise BlueprintError(f"reward.function {function!r} with reward.batched=true must return a list of {n} "
                                 f"scores for {n} samples, got {type(got).__name__} {got!r:.80}")
        out += [to_score(function, v) for v in got]
    return out


def overlong_penalty(response_len: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (verl's DAPORewardManager): 0 up to max_len - buffer_len tokens, then
    falling linearly to -factor at max_len."""
    exceed = response_len - (max_len - buffer_len)
    return min(-exceed / buffer_len * factor, 0.0)


# ---------------------------------------------------------------------------------------------------
def _import(name: str, *, field: str, what: str):
    return import_user_module(name, field=field, what=what, how_to_register=_HOW_TO_REGISTER)


def to_score(name: str, value: Any) -> float:
    """Turn a reward function's return value into a finite float, or raise naming the function."""
    if isinstance(value, dict):
        if "score" not in value:
            raise BlueprintError(
                f"reward.function {name!r} returned a dict without a 'score' key (keys: {sorted(value)[:10]})."
            )
        value = value["score"]
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    try:
        score = float(value)  # bool, int, float, numpy / 0-d torch scalars
    except (TypeError, ValueError):
        raise BlueprintError(
            f"reward.function {name!r} returned {type(value).__name__} {value!r:.80}; it must return a number "
            "(or a dict with a 'score')."
        ) from None
    if not math.isfinite(score):
        raise NonFiniteError(f"reward.function {name!r} returned a non-finite score ({score}); rewards must be finite.")
    return score


def _checked(name: str, fn: RewardFn) -> Callable[..., float]:
    def reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> float:
        try:
            out = fn(data_source, solution_str, ground_truth, extra_info=extra_info)
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"(raised by reward.function {name!r})")
            raise
        return to_score(name, out)

    reward.__name__ = f"reward[{name}]"
    reward.__qualname__ = reward.__name__
    reward.__doc__ = getattr(fn, "__doc__", None)
    reward.reward_name = name  # type: ignore[attr-defined]
    reward.wrapped = fn  # type: ignore[attr-defined]
    return reward


# ---------------------------------------------------------------------------------------------------
# Built-ins.

@register_reward("verl_default")
def verl_default(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None):
    """verl's ``default_compute_score``: picks a scorer by ``data_source`` (openai/gsm8k, MATH, math_dapo,
    numina_*, geometry3k, searchR1_*, code sets without a sandbox)."""
    from verl.utils.reward_score import default_compute_score  # lazy: `import verl` takes seconds

    try:
        return default_compute_score(data_source, solution_str, ground_truth, extra_info=extra_info)
    except NotImplementedError as e:
        raise BlueprintError(
            f"reward.function 'verl_default': verl has no scorer for data_source {data_source!r} ({e}). "
            "It knows openai/gsm8k, lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500, "
            "math_dapo, math, aime*, numina_*, codecontests/apps/codeforces/taco, hiyouga/geometry3k, searchR1_*. "
            "Pick another reward.function for this dataset. " + _HOW_TO_REGISTER
        ) from e


_SPECIAL = re.compile(r"<\|[A-Za-z_]+\|>")


def _clean_response(text: str) -> str:
    """A response as the reward sees it: up to the first end-of-turn marker, special tokens removed."""
    text = text.split("<|end|>", 1)[0]
    return _SPECIAL.sub("", text).strip()


@register_reward("tiny_digits")
def tiny_digits(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> float:
    """The tiny kit's task ("Write the digit 7 three times." -> "777"), scored densely in [0, 1]:

      0.25 if the response holds any digit
    + 0.25 x (fraction of its non-space characters that are digits)
    + 0.30 x (count of the target digit / max(response length, answer length))
    + 0.20 if the response is exactly the answer (surrounding spaces ignored).

    The response is cut at the first "<|end|>" and "<|...|>" markers are removed first.
    "777" -> 1.0; "77777" -> 0.8; "7a7" -> 0.62; "123" -> 0.5; "7" -> 0.6; "abc" -> 0.0; "" -> 0.0.
    The "any digit" term is there because a random-init model's samples are long (16 tokens, ~25 characters):
    its digit fraction is ~0.03, but about one sample in three holds a digit - a signal GRPO can use at once.
    """
    gt = str(ground_truth).strip()
    resp = _clean_response(solution_str)
    chars = [c for c in resp if not c.isspace()]
    if not chars:
        return 0.0
    n_digits = sum(c in "0123456789" for c in chars)
    if n_digits == 0:
        return 0.0
    target = gt[:1]
    n_target = sum(c == target for c in chars) if target else 0
    digit_frac = n_digits / len(chars)
    target_frac = n_target / max(len(chars), len(gt))
    exact = 1.0 if resp == gt else 0.0
    return 0.25 + 0.25 * digit_frac + 0.3 * target_frac + 0.2 * exact


@register_reward("exact_match")
def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> float:
    """1.0 when the response (up to an end-of-turn marker, spaces trimmed) equals the ground truth, else 0.0."""
    return 1.0 if _clean_response(solution_str) == str(ground_truth).strip() else 0.0
