"""The deterministic flag a stage sets: on and off in one process (a warm pool's jobs), without loading inductor
when it stays off (that import is ~2 s of every stage rank's start)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import sys, torch
from verlflow.core.stages.common import _set_deterministic
_set_deterministic(False)
print("off", torch.are_deterministic_algorithms_enabled(), "torch._inductor.config" in sys.modules)
_set_deterministic(True)
import torch._inductor.config as ic
print("on", torch.are_deterministic_algorithms_enabled(), ic.deterministic)
_set_deterministic(False)
print("off", torch.are_deterministic_algorithms_enabled(), ic.deterministic)
"""


def test_deterministic_turns_on_and_off_and_leaves_inductor_unloaded_while_off():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:3] == ["off False False", "on True True", "off False False"], out
