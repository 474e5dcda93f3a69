import pytest

from tskv import EndpointError, offset_endpoint_port
from tskv.core.endpoints import check_endpoint, should_bind


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://::1:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router.local:5557", False),
    ],
)
def test_bind_or_connect(endpoint: str, binds: bool) -> None:
    assert should_bind(endpoint) is binds


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        (None, 3, None),
        ("tcp://*:5557", 2, "tcp://*:5559"),
        ("tcp://127.0.0.1:5557", 1, "tcp://127.0.0.1:5558"),
        ("tcp://[::1]:6000", 5, "tcp://[::1]:6005"),
        ("tcp://127.0.0.1:0", 4, "tcp://127.0.0.1:0"),
        ("inproc://kv", 2, "inproc://kv_dp2"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
        ("tcp://*:65534", 1, "tcp://*:65535"),
        ("tcp://127.0.0.1:*", 3, "tcp://127.0.0.1:*"),
    ],
)
def test_offset_endpoint_port(endpoint: str | None, rank: int, expected: str | None) -> None:
    assert offset_endpoint_port(endpoint, rank) == expected


@pytest.mark.parametrize(
    ("endpoint", "rank", "says"),
    [
        ("ipc:///tmp/kv", 1, "cannot offset ipc endpoint"),
        ("tcp://*:65535", 1, "port 65536, past 65535"),
        ("tcp://*:5557", -1, "dp_rank = -1 must not be negative"),
        ("tcp://*:abc", 1, "no numeric port"),
        ("tcp://localhost", 1, "no numeric port"),
        ("udp://*:5557", 1, "only tcp:// and inproc://"),
    ],
)
def test_offset_refusals_name_the_problem(endpoint: str, rank: int, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        offset_endpoint_port(endpoint, rank)


def test_rank_must_be_int() -> None:
    with pytest.raises(TypeError, match="dp_rank"):
        offset_endpoint_port("tcp://*:1", "1")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "good", ["tcp://*:5557", "tcp://127.0.0.1:0", "tcp://[::1]:*", "ipc:///x", "inproc://a"]
)
def test_check_endpoint_accepts(good: str) -> None:
    assert check_endpoint(good) == good


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("localhost:5557", "not a ZeroMQ address"),
        ("http://x:1", "not a ZeroMQ address"),
        ("tcp://", "names no address"),
        ("tcp://host", "no host:port"),
        ("tcp://host:99999", "port '99999'"),
        ("tcp://host:abc", "port 'abc'"),
    ],
)
def test_check_endpoint_refuses(bad: str, says: str) -> None:
    with pytest.raises(EndpointError, match=says):
        check_endpoint(bad)
