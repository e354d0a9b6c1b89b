import json
from pathlib import Path

from ipc.messages import SamplingParams

_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p")


def default_sampling_params(model_folder: str | None, **overrides) -> SamplingParams:
    """vLLM's defaults, with the sampling settings of the model's generation_config.json
    (temperature, top_p, top_k, min_p) on top, as vLLM's `generation_config="auto"`."""
    defaults = {}
    path = Path(model_folder or "") / "generation_config.json"
    if model_folder and path.is_file():
        config = json.loads(path.read_text())
        defaults = {k: config[k] for k in _GENERATION_KEYS if config.get(k) is not None}
    return SamplingParams(**{**defaults, **overrides})
