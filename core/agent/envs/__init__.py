"""The shipped environments; importing this package registers them (verlflow.core.agent.registry)."""

from verlflow.core.agent.envs import calculator, python, verl_tools  # noqa: F401 - they register on import
