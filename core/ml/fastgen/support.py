"""The model families the static engine runs. Torch-free, so the driver's preflight can read it cheaply."""

from verlflow.core.ml.fastgen.families import FAMILIES

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)  # llama, qwen2, qwen3, mistral, phi3, gemma2, gemma3_text, olmo2
