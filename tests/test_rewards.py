"""The reward registry: built-ins, user modules, 'module:function', and errors that say what to do."""

import math
import os
import subprocess
import sys
import textwrap
import uuid
import pytest

pytestmark = pytest.mark.unit

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402

from verlflow.core.errors import BlueprintError, NonFiniteError, VerlflowError  # noqa: E402
from verlflow.core.ml import rewards  # noqa: E402
from verlflow.core.ml.rewards import get_reward, load_reward, register_reward, reward_names  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_registry():
    saved = dict(rewards._REGISTRY)
    yield
    rewards._REGISTRY.clear()
    rewards._REGISTRY.update(saved)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a module into tmp_path (a fresh name each time) and put tmp_path on sys.path."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(body: str) -> str:
        name = f"user_rewards_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
        return name

    return write


def test_builtins_registered():
    assert {"verl_default", "tiny_digits", "exact_match"} <= set(reward_names())


def test_tiny_digits_partial_credit_ordering():
    f = get_reward("tiny_digits")
    s = {r: f("tiny_digits", r, "777") for r in ["777", "77777", "7a7", "123", "7", "abc", "", "   "]}
    assert s["777"] == 1.0
    assert s["777"] > s["77777"] > s["7a7"] > s["123"] > s["abc"] == 0.0
    assert s["7"] > s["123"]
    assert s[""] == s["   "] == 0.0
    assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in s.values())
    # the rollout may or may not strip special tokens: the score is the same
    assert f("tiny_digits", "777<|end|><|pad|><|pad|>", "777") == 1.0
    assert f("tiny_digits", " 777 ", "777") == 1.0
    # more digits and the right digit score higher (dense signal for a random model)
    assert f("tiny_digits", "x7y7z", "777") > f("tiny_digits", "x1y1z", "777") > f("tiny_digits", "xayaz", "777")


def test_exact_match():
    f = get_reward("exact_match")
    assert f("d", " 42 ", "42") == 1.0 and f("d", "42<|end|>junk", "42") == 1.0 and f("d", "43", "42") == 0.0


def test_verl_default_gsm8k():
    f = get_reward("verl_default")
    assert f("openai/gsm8k", "She has 40 + 2 apples.\n#### 42", "42") == 1.0
    assert f("openai/gsm8k", "She has 40 + 1 apples.\n#### 41", "42") == 0.0
    assert f("openai/gsm8k", "no final answer", "42") == 0.0
    out = f("openai/gsm8k", "#### 42", "42", extra_info={"split": "test", "index": 0})
    assert type(out) is float
    # math_dapo returns a dict {"score", "acc", "pred"}: the score comes out as a float
    assert f("math_dapo", "The answer is\nAnswer: 42", "42") == 1.0
    with pytest.raises(BlueprintError, match=r"(?s)no scorer for data_source 'tiny_digits'.*reward.function"):
        f("tiny_digits", "777", "777")


def test_import_is_light():
    """Importing the registry must not import verl (seconds, and it reconfigures the root logger)."""
    code = "import sys, verlflow.core.ml.rewards; assert 'verl' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_unknown_name_explains_how_to_fix():
    with pytest.raises(BlueprintError) as e:
        get_reward("no_such_reward")
    msg = str(e.value)
    for part in ("reward.function", "'no_such_reward'", "tiny_digits", "verl_default", "exact_match",
                 "reward.module", "register_reward", "mypkg.rewards:my_function"):
        assert part in msg, (part, msg)
    with pytest.raises(BlueprintError, match="no_such_reward"):
        load_reward("no_such_reward")


def test_user_module_registration(user_module):
    mod = user_module(
        """
        from verlflow.core.ml.rewards import register_reward

        @register_reward("starts_with_answer")
        def starts_with_answer(data_source, solution_str, ground_truth, extra_info=None):
            return solution_str.startswith(ground_truth)   # a bool: becomes 1.0 / 0.0
        """
    )
    with pytest.raises(BlueprintError):
        get_reward("starts_with_answer")  # not imported yet
    f = load_reward("starts_with_answer", module=mod)
    assert f("x", "42 and more", "42") == 1.0 and f("x", "nope", "42") == 0.0
    assert "starts_with_answer" in reward_names()
    # loading again (module already imported) is fine
    assert load_reward("starts_with_answer", module=mod)("x", "42", "42") == 1.0


def test_module_colon_function(user_module):
    mod = user_module(
        """
        def length_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": min(len(solution_str), 10) / 10, "length": len(solution_str)}

        NOT_CALLABLE = 3
        """
    )
    f = load_reward(f"{mod}:length_score")
    assert f("x", "abcde", "") == 0.5
    with pytest.raises(BlueprintError, match=r"reward.function.*no attribute 'missing'"):
        load_reward(f"{mod}:missing")
    with pytest.raises(BlueprintError, match="not callable"):
        load_reward(f"{mod}:NOT_CALLABLE")
    with pytest.raises(BlueprintError, match=r"reward.function: cannot import module 'no_such_pkg_xyz'"):
        load_reward("no_such_pkg_xyz:fn")


def test_bad_module_names_reward_module(user_module):
    with pytest.raises(BlueprintError, match=r"reward.module: cannot import 'no_such_pkg_xyz'"):
        load_reward("tiny_digits", module="no_such_pkg_xyz")
    broken = user_module("raise RuntimeError('boom at import')\n")
    with pytest.raises(BlueprintError, match=r"reward.module.*RuntimeError: boom at import"):
        load_reward("tiny_digits", module=broken)


def test_bad_return_values_name_the_function():
    @register_reward("returns_nan")
    def returns_nan(data_source, solution_str, ground_truth, extra_info=None):
        return float("nan")

    @register_reward("returns_text")
    def returns_text(data_source, solution_str, ground_truth, extra_info=None):
        return "high"

    @register_reward("returns_dict_without_score")
    def returns_dict(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": 1}

    @register_reward("raises")
    def raises(data_source, solution_str, ground_truth, extra_info=None):
        raise ValueError("bad ground truth")

    with pytest.raises(NonFiniteError, match="'returns_nan'.*non-finite"):
        get_reward("returns_nan")("d", "s", "g")
    with pytest.raises(BlueprintError, match="'returns_text'.*must return a number"):
        get_reward("returns_text")("d", "s", "g")
    with pytest.raises(BlueprintError, match="'returns_dict_without_score'.*'score'"):
        get_reward("returns_dict_without_score")("d", "s", "g")
    with pytest.raises(ValueError, match="bad ground truth") as e:
        get_reward("raises")("d", "s", "g")
    if sys.version_info >= (3, 11):
        assert any("'raises'" in n for n in e.value.__notes__)
    assert issubclass(NonFiniteError, VerlflowError)
    assert math.isinf(float("inf"))  # sanity: +inf is refused too
    with pytest.raises(NonFiniteError):
        rewards.to_score("x", float("inf"))


def test_name_collisions():
    @register_reward("mine")
    def mine(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    register_reward("mine")(mine)  # the same function again (a module imported twice): fine
    with pytest.raises(BlueprintError, match="already taken"):
        @register_reward("tiny_digits")
        def other(data_source, solution_str, ground_truth, extra_info=None):
            return 0.0

    @register_reward("mine", overwrite=True)
    def replacement(data_source, solution_str, ground_truth, extra_info=None):
        return 0.25

    assert get_reward("mine")("d", "s", "g") == 0.25
    with pytest.raises(BlueprintError):
        register_reward("a:b")
