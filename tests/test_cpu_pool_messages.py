"""Control messages: every type round-trips, the schema is enforced on decode, the expert split map."""
from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from proto.expert_owners import ExpertSplit
from proto import messages as m

EXAMPLES = [
    m.Hello(1, 2, 4242, m.PROTOCOL_VERSION, "store", "cfg", "store.cpu1", 0, [0, 1], [0], ["avx2"], "avx2"),
    m.Config(),
    m.Config(kernel="torch", num_threads=3, spin_us=10.5, owner_map=b"\x00\x00\x01\x00", split_epoch=2),
    m.Ready(1, 4242, "cfg", "native-avx512_bf16", 16, 61.5, 2, 3),
    m.StatsRequest(),
    m.Stats(0, 10, 20, 40, 12, 10 ** 12, 5 * 10 ** 9, 1, 0, 2, 12.5),
    m.Rebalance(3, b"\x01\x00" * 6),
    m.Rebalanced(1, 3, 6),
    m.Shutdown("drain"),
    m.Error(1, "boom", fatal=True),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips(msg):
    frames = m.encode(msg)
    assert len(frames) == 2 and len(frames[0]) == 1
    assert frames[0][0] == m.TYPE_OF_CLASS[type(msg)]
    assert isinstance(msgpack.unpackb(frames[1]), dict)       # plain msgpack map, no pickle
    assert m.decode(frames) == msg


def test_every_type_has_an_example():
    assert {type(msg) for msg in EXAMPLES} == set(m.MESSAGE_TYPES.values())


def _frames(type_byte: int, payload: object) -> list[bytes]:
    return [bytes([type_byte]), msgpack.packb(payload, use_bin_type=True)]


def test_decode_rejects_what_the_schema_does_not_declare():
    good = dataclasses.asdict(m.Rebalanced(1, 3, 6))
    with pytest.raises(m.MessageError, match="unknown CPU worker control message type 200"):
        m.decode(_frames(200, good))
    with pytest.raises(m.MessageError, match="unknown field.*extra"):
        m.decode(_frames(m.MsgType.REBALANCED, {**good, "extra": 1}))
    with pytest.raises(m.MessageError, match="missing field.*num_owned"):
        m.decode(_frames(m.MsgType.REBALANCED, {k: v for k, v in good.items() if k != "num_owned"}))
    with pytest.raises(m.MessageError, match="split_epoch='3' is not"):
        m.decode(_frames(m.MsgType.REBALANCED, {**good, "split_epoch": "3"}))
    with pytest.raises(m.MessageError, match="is not <class 'int'>"):
        m.decode(_frames(m.MsgType.REBALANCED, {**good, "worker_index": True}))   # bool is not an int here
    with pytest.raises(m.MessageError, match="payload must be a map"):
        m.decode(_frames(m.MsgType.SHUTDOWN, ["drain"]))
    with pytest.raises(m.MessageError, match="not msgpack"):
        m.decode([bytes([m.MsgType.SHUTDOWN]), b"\xc1"])
    with pytest.raises(m.MessageError, match="frame"):
        m.decode([bytes([m.MsgType.SHUTDOWN])])
    with pytest.raises(m.MessageError, match="cpus"):
        m.decode(_frames(m.MsgType.HELLO, {**dataclasses.asdict(EXAMPLES[0]), "cpus": [0, "1"]}))


def test_defaults_fill_omitted_config_fields_and_ints_widen_to_float():
    msg = m.decode(_frames(m.MsgType.CONFIG, {"hot_ms": 5}))
    assert msg == m.Config(hot_ms=5.0) and isinstance(msg.hot_ms, float)


def test_encode_checks_types_too():
    with pytest.raises(m.MessageError, match="Shutdown.reason"):
        m.encode(m.Shutdown(reason=3))                          # type: ignore[arg-type]
    with pytest.raises(m.MessageError, match="not a CPU worker control message"):
        m.encode("hello")                                       # type: ignore[arg-type]


def test_contiguous_split_covers_every_expert_once():
    split = ExpertSplit.contiguous(num_layers=2, num_experts=10, num_workers=3)
    assert split.owner[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert sum(split.num_owned(w) for w in range(3)) == 20
    expert_id = np.array([9, 0, 4, 4, 7], dtype=np.int32)
    parts = split.split_triples(1, expert_id)
    assert [p.tolist() for p in parts] == [[1], [2, 3], [0, 4]]
    assert split.foreign_count(1, expert_id, worker=1) == 3


def test_split_survives_the_wire_and_rejects_bad_maps():
    split = ExpertSplit.contiguous(3, 4, 2)
    split.owner[2, 0] = 1
    msg = m.decode(m.encode(m.Rebalance(7, split.to_bytes())))
    again = ExpertSplit.from_bytes(msg.owner_map, 3, 4, 2)
    assert np.array_equal(again.owner, split.owner)
    with pytest.raises(ValueError, match="expected 24"):
        ExpertSplit.from_bytes(b"\x00" * 10, 3, 4, 2)
    with pytest.raises(ValueError, match="outside"):
        ExpertSplit.from_bytes(np.full(12, 5, dtype="<i2").tobytes(), 3, 4, 2)


def test_proportional_split_sizes_ranges_by_share():
    from proto.expert_owners import ExpertSplit
    split = ExpertSplit.proportional(2, 8, [3.0, 1.0])
    assert split.num_owned(0) == 12 and split.num_owned(1) == 4        # 6 and 2 experts a layer
    assert split.owner[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    idle = ExpertSplit.proportional(1, 8, [0.0, 1.0, 1.0])
    assert idle.num_owned(0) == 0 and idle.num_owned(1) == 4 and idle.num_owned(2) == 4
    for bad in ([], [1.0, -1.0], [0.0, 0.0], [float("nan")]):
        with pytest.raises(ValueError, match="shares"):
            ExpertSplit.proportional(1, 8, bad)
