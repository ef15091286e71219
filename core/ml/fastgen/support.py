"""The model families the static engine runs. Torch-free, so the driver's preflight can read it cheaply."""

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
