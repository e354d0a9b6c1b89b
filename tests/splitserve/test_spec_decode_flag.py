"""--speculative-config on the command line: vLLM's JSON, checked when parsed."""

import argparse

import pytest

from ipc.spec_config import SpeculativeConfig
from splitserve.engine_args import add_engine_args, engine_config


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    return add_engine_args(parser).parse_args(argv)


def test_the_flag_takes_vllm_json():
    args = _parse(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}',
        "--max-model-len",
        "64",
    )
    config = engine_config(args)
    assert config.speculative_config == SpeculativeConfig(
        num_speculative_tokens=5, prompt_lookup_max=3
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [('{"method": "eagle"}', "not available yet"), ('{"k": 2}', "unknown key"), ("[1]", "object")],
)
def test_a_bad_value_is_refused_when_parsed(text, message):
    with pytest.raises(argparse.ArgumentError, match=message):
        _parse("--speculative-config", text)
