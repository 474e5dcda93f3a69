import pytest

from tskv import ConfigError, KVEventsConfig, TskvWarning


def test_defaults_match_tokenspeed_and_vllm() -> None:
    config = KVEventsConfig()
    assert (config.publisher, config.endpoint, config.replay_endpoint) == (
        None,
        "tcp://*:5557",
        None,
    )
    assert (config.buffer_steps, config.hwm, config.max_queue_size) == (10_000, 100_000, 100_000)
    assert (config.topic, config.enable_kv_cache_events) == ("", False)


def test_from_json_reads_a_kv_events_config() -> None:
    config = KVEventsConfig.from_json(
        '{"publisher": "zmq", "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001",'
        ' "buffer_steps": 5, "hwm": 0, "max_queue_size": 7, "topic": "kv",'
        ' "enable_kv_cache_events": true}'
    )
    assert config == KVEventsConfig("zmq", "tcp://*:6000", "tcp://*:6001", 5, 0, 7, "kv", True)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"publisher": 3}', "publisher = 3: use a publisher's name"),
        ('{"endpoint": 5557}', "endpoint = 5557"),
        ('{"endpoint": "localhost:5557"}', "endpoint: endpoint 'localhost:5557'"),
        ('{"replay_endpoint": "x"}', "replay_endpoint: endpoint 'x'"),
        ('{"buffer_steps": -1}', "buffer_steps = -1: must be at least 1"),
        ('{"hwm": -5}', "hwm = -5: must be at least 0"),
        ('{"max_queue_size": 0}', "max_queue_size = 0: must be at least 1"),
        ('{"max_queue_size": "10"}', "max_queue_size = '10': must be an integer"),
        ('{"hwm": true}', "hwm = True: must be an integer"),
        ('{"topic": 3}', "topic = 3: must be a str"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events = 'yes'"),
    ],
)
def test_bad_config_names_the_key(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        KVEventsConfig.from_json(text)


def test_unknown_keys_are_accepted_and_named_to_warn() -> None:
    said: list[str] = []
    config = KVEventsConfig.from_json('{"lora": 1, "backend_id": "w", "topic": "t"}', said.append)
    assert config.topic == "t"
    assert len(said) == 1 and "backend_id, lora" in said[0]
    with pytest.warns(TskvWarning, match="backend_id"):  # no warn given: Python's
        KVEventsConfig.from_mapping({"backend_id": "w"})


@pytest.mark.parametrize(
    ("text", "enabled"),
    [
        ("{}", False),
        ('{"enable_kv_cache_events": true}', True),
        ('{"enable_kv_cache_events": true, "publisher": "zmq"}', True),
        ('{"enable_kv_cache_events": true, "publisher": "null"}', False),
        ('{"enable_kv_cache_events": true, "publisher": null}', True),
        ('{"enable_kv_cache_events": false, "publisher": "zmq"}', False),
    ],
)
def test_enabled_follows_tokenspeed(text: str, enabled: bool) -> None:
    assert KVEventsConfig.from_json(text).enabled is enabled


def test_the_wire_decides_the_reply_layout_and_snapshots_need_a_replay_endpoint() -> None:
    from tskv.core.wire_format import Layout, layout

    assert layout("vllm", "kv") == Layout(reply_topic=b"kv", tiered_state=True)
    assert layout("tokenspeed", "kv") == Layout(reply_topic=None, tiered_state=False)
    config = KVEventsConfig(wire_format="vllm", topic="t")
    assert config.layout == Layout(b"t", True)
    assert config.serves_snapshots("tcp://127.0.0.1:5558")
    assert not config.serves_snapshots(None)  # snapshots are served on the replay socket
    assert not KVEventsConfig(snapshots=False).serves_snapshots("tcp://127.0.0.1:5558")
