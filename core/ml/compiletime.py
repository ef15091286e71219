"""What torch.compile cost this process so far: dynamo's frame compiles and the backward graphs compiled lazily at
the first backward. A stage's first run pays them inside ref_s, train_s or the engine's set-up; its manifest names
them apart (compile_s, compiles), so a first iteration's excess says how much of it was compiling."""

KEYS = ("_compile.compile_inner", "backward._backward_impl")


def snapshot() -> tuple[int, float]:
    """(compiles, seconds) since the process started."""
    from torch._dynamo.utils import compilation_time_metrics

    runs = [t for k in KEYS for t in compilation_time_metrics.get(k, ())]
    return len(runs), sum(runs)
