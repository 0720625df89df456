"""Records filled without Flower's per-entry check are the records Flower's constructors
make, and anything Flower would check still goes through its constructors."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from client.protocol.npy import NPY_STYPE, npy_array
from client.protocol.records import array, array_record, metric_record, record_dict


def _same(fast, slow) -> None:
    assert type(fast) is type(slow)
    assert fast == slow and dict(fast) == dict(slow)
    assert fast.object_id == slow.object_id  # what Flower's transports hash and send
    assert fast.deflate() == slow.deflate()


def test_plain_metrics_make_flowers_record():
    values = {"num-examples": 15, "train_loss": 0.25, "fedring.partition": 3}
    fast = metric_record(values)
    _same(fast, MetricRecord(dict(values)))
    values["num-examples"] = 99  # the record has its own entries
    assert fast["num-examples"] == 15
    with pytest.raises(TypeError):  # and checks what is set later, as Flower's does
        fast["x"] = "text"


@pytest.mark.parametrize("bad", [True, "0.5", np.float32(0.5), None])
def test_other_metric_values_get_flowers_check(bad):
    with pytest.raises(TypeError):
        metric_record({"train_loss": bad})


def test_float_subclasses_and_lists_are_left_to_flower():
    fast = metric_record({"a": np.float64(0.5), "b": [1, 2]})  # Flower accepts both
    _same(fast, MetricRecord({"a": np.float64(0.5), "b": [1, 2]}))


def test_arrays_and_record_dicts_match_flowers():
    arrays = {"w": npy_array(np.arange(6, dtype=np.float32).reshape(2, 3)),
              "b": npy_array(np.ones(3, np.float32))}
    slow_arrays = ArrayRecord()
    for k, v in arrays.items():
        slow_arrays[k] = v
    fast_arrays = array_record(arrays)
    _same(fast_arrays, slow_arrays)
    records = {"arrays": fast_arrays, "metrics": metric_record({"n": 1}),
               "config": ConfigRecord({"k": "v"})}
    fast = record_dict(records)
    _same(fast, RecordDict(dict(records)))
    # a whole content built of them can be deflated object by object, as Flower sends it
    slow_objects = get_all_nested_objects(RecordDict(dict(records)))
    assert set(get_all_nested_objects(fast)) == set(slow_objects)


@pytest.mark.parametrize("bad", [{"w": np.ones(3)}, {3: Array("float32", (1,), NPY_STYPE,
                                                              b"\0" * 4)}])
def test_array_records_check_what_is_not_an_array(bad):
    with pytest.raises(TypeError):
        array_record(bad)


def test_record_dict_checks_what_is_not_a_record():
    with pytest.raises(TypeError):
        record_dict({"metrics": {"n": 1}})


def test_array_equals_flowers_and_takes_a_buffer():
    data = npy_array(np.arange(4, dtype=np.float32)).data
    fast = array("float32", (4,), NPY_STYPE, data)
    slow = Array(dtype="float32", shape=(4,), stype=NPY_STYPE, data=data)
    assert fast.__dict__.keys() - {"_is_dirty"} == slow.__dict__.keys() - {"_is_dirty"}
    assert (fast.dtype, fast.shape, fast.stype, fast.data) == (slow.dtype, slow.shape,
                                                               slow.stype, slow.data)
    assert fast.object_id == slow.object_id
    np.testing.assert_array_equal(fast.numpy(), np.arange(4, dtype=np.float32))
    buffer = bytearray(data)  # in-process replies share a buffer (Flower wants bytes)
    assert array("float32", (4,), NPY_STYPE, buffer).data is buffer
    with pytest.raises(TypeError):  # a shape that is not a tuple of ints: Flower's check
        array("float32", [4], NPY_STYPE, data)
