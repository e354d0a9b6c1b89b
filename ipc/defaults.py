import json
from pathlib import Path

from ipc.sampling_params import SamplingParams

_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def defaults_from_generation_config(generation_config: dict) -> dict:
    """The sampling settings of a parsed generation_config.json (temperature, top_p,
    top_k, min_p, repetition_penalty): defaults under whatever a request sets, as vLLM's
    `--generation-config auto`. An explicit `"do_sample": false` means greedy, as it does
    in transformers (where the repetition penalty still applies)."""
    found = {
        k: generation_config[k] for k in _GENERATION_KEYS if generation_config.get(k) is not None
    }
    if generation_config.get("do_sample") is False:
        return {"temperature": 0.0, **{k: v for k, v in found.items() if k == "repetition_penalty"}}
    return found


def generation_defaults(model_folder: str | None) -> dict:
    """`defaults_from_generation_config` of the model folder's generation_config.json."""
    path = Path(model_folder or "") / "generation_config.json"
    if not model_folder or not path.is_file():
        return {}
    return defaults_from_generation_config(json.loads(path.read_text()))


def default_sampling_params(model_folder: str | None, **overrides) -> SamplingParams:
    return SamplingParams(**{**generation_defaults(model_folder), **overrides})
