"""What torch.compile cost this process so far: dynamo's frame compiles and the backward graphs compiled lazily at
the first backward. A stage's first run pays them inside ref_s, train_s or the engine's set-up; its manifest names
them apart (compile_s, compiles), so a first iteration's excess says how much of it was compiling."""

KEYS = ("_compile.compile_inner", "backward._backward_impl")
# dynamo's timers nest; these do not contain one another: tracing, guards, the cache's loads, code generation
PHASES = ("bytecode_tracing", "build_guards", "aot_collect_metadata", "AOTAutogradCache.inductor_load",
          "fx_codegen_and_compile", "async_compile.wait")


def _totals() -> dict[str, tuple[int, float]]:
    from torch._dynamo.utils import compilation_time_metrics

    return {k: (len(v), sum(v)) for k, v in list(compilation_time_metrics.items())}


class Meter:
    """Compiles between start and `read()`: (count, seconds, where they went: PHASES and any autotuning that took
    at least `min_s`, so a log line names only what mattered)."""

    def __init__(self):
        self._start = _totals()

    def read(self, min_s: float = 0.05) -> tuple[int, float, dict[str, float]]:
        now = _totals()
        spent = {k: s - self._start.get(k, (0, 0.0))[1] for k, (_, s) in now.items()}
        n = sum(now.get(k, (0, 0.0))[0] - self._start.get(k, (0, 0.0))[0] for k in KEYS)
        parts = {k: round(v, 3) for k, v in spent.items() if (k in PHASES or "autotune" in k) and v >= min_s}
        return n, sum(spent.get(k, 0.0) for k in KEYS), parts
