"""Catalog records: the bytes a record is written as, and reading them back."""

from __future__ import annotations

import json

import pytest

from tierstore.catalog import Record
from tierstore.tensors import DTYPES


def _json(rec: Record) -> bytes:
    """A record as the JSON encoder writes it: the catalog's format."""
    return json.dumps(vars(rec), separators=(",", ":")).encode()


CASES = [
    Record("float32", [64, 1024], 262144, [123456789], 8 << 20, 12345, 0, 1 << 30, 262144),
    Record("bool", [], 1, [0], 1 << 20, 1, 3, 4096, 4096),
    Record("bfloat16", [0, 5], 0, [0], 65536, 7, -1, 0, 0),
    Record("int64", [3, 1, 2], 48, [4294967295, 0, 17], 16, 2**62, 2**31, 2**40, 4096,
           extra={"source": "hf", "note": 'quote " and \\ and é', "n": [1, 2.5, None]}),
    *[Record(name, [2, 2], 16, [1], 1 << 20, 1, 0, 0, 4096) for name in sorted(DTYPES)],
]


@pytest.mark.parametrize("rec", CASES, ids=lambda r: f"{r.dtype}-{len(r.crc)}-{bool(r.extra)}")
def test_a_record_is_written_as_json_and_read_back(rec: Record) -> None:
    assert rec.encode() == _json(rec)
    assert Record.decode(rec.encode()) == rec
    assert Record.decode(_json(rec)) == rec


def test_a_dtype_name_json_must_escape_still_round_trips() -> None:
    rec = Record('odd"name', [1], 1, [0], 1, 1, 0, 0, 4096)
    assert rec.encode() == _json(rec)
    assert Record.decode(rec.encode()) == rec


@pytest.mark.parametrize("raw", [b' {"dtype":"float32"}', b'{"dtype":"float32"} x', b"[1, 2]",
                                 b"", b"{"])
def test_a_record_that_is_not_one_json_object_is_refused(raw: bytes) -> None:
    with pytest.raises((ValueError, TypeError)):
        Record.decode(raw)
