import json
from pathlib import Path

from ipc.messages import SamplingParams

_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p")


def generation_defaults(model_folder: str | None) -> dict:
    """The sampling settings of the model's generation_config.json (temperature, top_p,
    top_k, min_p): defaults under whatever a request sets, as vLLM's
    `--generation-config auto`. An explicit `"do_sample": false` means greedy, as it does
    in transformers."""
    path = Path(model_folder or "") / "generation_config.json"
    if not model_folder or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: config[k] for k in _GENERATION_KEYS if config.get(k) is not None}


def default_sampling_params(model_folder: str | None, **overrides) -> SamplingParams:
    return SamplingParams(**{**generation_defaults(model_folder), **overrides})
