"""`--kv-transfer-config` and `kv_transfer_params` are checked where they enter: every
mistake is an error naming what is wrong; the transfer key binds every field it covers."""

from __future__ import annotations

import argparse

import pytest

from ipc.auth import Credentials
from ipc.config import EngineConfig
from ipc.kv_transfer import (
    KVTransferConfig,
    KVTransferParams,
    parse_kv_transfer_config,
    prompt_hash,
    transfer_key,
    transfer_secret,
)
from splitserve.disagg_proxy import PREFILL_KV_PARAMS


def test_config_from_json_with_vllms_keys():
    config = KVTransferConfig.from_value(
        '{"kv_connector": "ZmqConnector", "kv_role": "kv_producer", "kv_port": 15000,'
        ' "kv_connector_extra_config": {"send_timeout_s": 5}}'
    )
    assert (config.is_producer, config.is_consumer, config.kv_port) == (True, False, 15000)
    assert config.extra("send_timeout_s") == 5 and config.extra("pull_timeout_s") == 30.0
    assert len(config.engine_id) == 32
    assert (
        EngineConfig(max_model_len=64, kv_transfer_config=vars(config)).kv_transfer_config == config
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"kv_connector": "NixlConnector"}', "unknown kv_connector 'NixlConnector'"),
        ('{"kv_role": "kv_both_ways"}', "kv_role must be one of"),
        ('{"kv_port": 0}', "kv_port must be in"),
        ('{"kv_port": "14579"}', "kv_port must be in"),
        ('{"kv_buffer_size": 1e9}', "unknown key(s) kv_buffer_size"),
        ('{"kv_connector_extra_config": {"pull_timeout_s": 0}}', "pull_timeout_s must be"),
        ('{"kv_connector_extra_config": {"backend": "ucx"}}', "unknown kv_connector_extra"),
    ],
)
def test_config_mistakes_are_named(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        KVTransferConfig.from_value(value)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_kv_transfer_config(value)


def pull_fields(**overrides):
    fields = dict(
        do_remote_prefill=True,
        remote_block_ids=[[1, 2]],
        remote_host="h",
        remote_port=9,
        remote_tp_size=1,
        transfer_id="t",
        transfer_key="k",
        prompt_hash="p",
        expires=1.5,
    )
    return {**fields, **overrides}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"do_remote_decode": True, "surprise": 1}, "unknown field `surprise`"),
        ({"do_remote_decode": "yes"}, "Expected `bool`"),
        (pull_fields(remote_port=70000), "remote_port must be in"),
        (pull_fields(transfer_key=None), "do_remote_prefill needs transfer_key"),
        (pull_fields(do_remote_decode=True), "exclude each other"),
        ([1], "Expected `object`"),
    ],
)
def test_params_mistakes_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        KVTransferParams.from_dict(value)


def test_vllms_prefill_request_params_are_accepted():
    """What the proxy sends a prefill instance: vLLM's shape, nulls included."""
    params = KVTransferParams.from_dict(PREFILL_KV_PARAMS)
    assert params.to_dict() == {"do_remote_decode": True}


def test_the_key_binds_every_field_it_covers():
    secret = transfer_secret(Credentials.generate())
    fields = ("engine", 14579, "t", [[1, 2, 3]], 100.5)
    key = transfer_key(secret, *fields)
    assert key == transfer_key(secret, *fields)
    for i, other in enumerate(("other", 14580, "u", [[1, 2, 4]], 100.6)):
        changed = list(fields)
        changed[i] = other
        assert transfer_key(secret, *changed) != key
    assert transfer_key(transfer_secret(Credentials.generate()), *fields) != key
    assert prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 4]) == prompt_hash([1, 2, 4])
