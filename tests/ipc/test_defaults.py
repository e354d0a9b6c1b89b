import json

from ipc.defaults import default_sampling_params, generation_defaults


def _folder(tmp_path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_sampling_settings_of_the_generation_config(tmp_path):
    folder = _folder(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos": 2})
    assert generation_defaults(folder) == {"temperature": 0.6, "top_p": 0.9}
    params = default_sampling_params(folder, top_p=0.5)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.5, 16)


def test_do_sample_false_means_greedy(tmp_path):
    folder = _folder(tmp_path, {"do_sample": False, "temperature": 0.6})
    assert generation_defaults(folder) == {"temperature": 0.0}


def test_the_repetition_penalty_of_the_generation_config_applies_greedy_or_not(tmp_path):
    config = {"temperature": 0.7, "repetition_penalty": 1.05}
    assert generation_defaults(_folder(tmp_path, config)) == config
    config["do_sample"] = False
    expected = {"temperature": 0.0, "repetition_penalty": 1.05}
    assert generation_defaults(_folder(tmp_path, config)) == expected
    assert default_sampling_params(str(tmp_path), repetition_penalty=1.0).repetition_penalty == 1.0


def test_no_generation_config_means_vllm_defaults(tmp_path):
    assert generation_defaults(str(tmp_path)) == {}
    assert generation_defaults(None) == {}
    assert default_sampling_params(None).temperature == 1.0
