"""The rank-side runtime around a stage worker: what a stage gets (context.py: StageContext, with `ctx.models`,
models.py, and `ctx.write`, commit.py) and what it never sees: the warm pool's model cache (cache.py), its
background committer (committer.py), its serve loop (serve.py), a rank's start and exit (entry.py).

Plumbing: no module here is hashed into a stage's key (core/store/keys.py), so none may compute a stage's outputs.
Models taken from memory equal what a load gives, bit for bit (tests/test_stages.py, tests/test_pool.py); the load
itself is the stage's (core/stages/loads.py). Nothing is imported here: a probe imports entry.py before torch.
"""
