"""Multi-turn agent rollouts: environments (env.py, registry.py, envs/), tool calls (toolcalls.py), the
sandbox for code execution (sandbox.py) and the turn loop that drives them (loop.py)."""
