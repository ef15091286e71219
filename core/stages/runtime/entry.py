"""A rank's start and end under torchrun: the guard that ties it to torchrun, the trimmed transformers import, and
the exit without the interpreter's teardown. Stage workers (stages/common.py stage_main), the warm pool's serve loop
and the test probes (core/testing) start this way; verlflow.core.orchestrate.launcher is the driver's side.
"""

import faulthandler
import importlib
import logging
import os
import sys
from typing import Callable

from verlflow.core.guard import STACK_SIGNAL, die_with_parent, is_torchrun, under_torchrun

# transformers imports these whenever installed, for what no stage uses: `roc_curve` for assisted decoding
# (generation's candidate_generator; MLflow installs scikit-learn) and `linear_sum_assignment` for object-detection
# losses (every model's modeling_utils imports them). Hidden while transformers imports those modules.
UNUSED_BY_STAGES = ("sklearn", "scipy")
IMPORTED_WITHOUT = ("transformers.loss.loss_for_object_detection", "transformers.generation.candidate_generator")


def _transformers_without_unused_imports() -> None:
    """scikit-learn and scipy (with pandas) cost every rank of every stage job 4-8 s of imports on 2 cores. Import
    the transformers modules that want them once with them hidden (find_spec takes None in sys.modules for absent),
    then unhide them: a user's reward function may import them. (accelerate cannot go the same way:
    modeling_utils binds its names at import, and save_pretrained calls them.)"""
    if any(m in sys.modules for m in IMPORTED_WITHOUT + UNUSED_BY_STAGES):
        return
    for h in UNUSED_BY_STAGES:
        sys.modules[h] = None
    try:
        for module in IMPORTED_WITHOUT:
            importlib.import_module(module)
    except ImportError:  # a rank without transformers (a probe) has nothing to speed up
        pass
    finally:
        for h in UNUSED_BY_STAGES:
            sys.modules.pop(h, None)


def worker_guard() -> None:
    """Call first thing in a stage worker: it dies with torchrun (which starts it in its own session),
    and its stderr joins its stdout, so one rank's lines keep their order (torchrun tails each file
    in its own thread)."""
    if not under_torchrun():
        die_with_parent()  # run by hand: dies with its shell
    else:
        os.dup2(1, 2)
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
        die_with_parent(is_torchrun)  # torchrun may have died already: then our parent is init or a subreaper
    if "verlflow.core.stages.common" in sys.modules:  # a stage worker (not a probe): it will load models
        _transformers_without_unused_imports()


def run_and_exit(entry: Callable[[], None]) -> None:
    """Run a rank's @record'ed entry point, then leave without the interpreter's teardown: exit code 0 after
    success, 1 after an error (printed as Python would; @record has written torchrun's error file). The teardown
    of torch's process-group threads sometimes aborts ("terminate called without an active exception", SIGABRT;
    seen in 1 of 12 2-rank jobs, after errors and after successes alike), which turned a finished rank into a
    signal death. Everything a stage writes is committed (or failed) before its entry returns."""
    code = 0
    try:
        entry()
    except SystemExit as e:  # sys.exit(n) / sys.exit("message"), as the interpreter would treat them
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
