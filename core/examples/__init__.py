"""Examples of verlflow's extension points (a user stage: judge.py)."""
