"""verlflow core: blueprints, artifact store, torchrun launcher and the stage workers."""

__version__ = "0.1.0"
