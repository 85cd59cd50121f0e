"""Catalog records: the bytes a record is written as, and reading them back (in full, or
the numbers a commit needs of the record it replaces)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from tierstore.catalog import Catalog, Record, entry_key, record_numbers
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


def _replaced_of(raw: bytes) -> tuple[int, ...]:
    """What a commit reads of a record it replaces, as a real LMDB transaction hands it."""
    with tempfile.TemporaryDirectory() as d:
        cat = Catalog(os.path.join(d, "catalog.mdb"), create=True)
        try:
            with cat.env.begin(write=True) as txn:
                txn.put(entry_key("e", "param"), raw, db=cat.db["entries"])
                prev = txn.cursor(db=cat.db["entries"]).replace(entry_key("e", "param"), b"{}")
                return record_numbers(prev)
        finally:
            cat.close()


@pytest.mark.parametrize("rec", [*CASES, Record('odd"name', [1], 1, [0], 1, 1, 0, 0, 4096)],
                         ids=lambda r: f"{r.dtype}-{len(r.crc)}-{bool(r.extra)}")
@pytest.mark.parametrize("spelling", ["encoded", "spaced"])
def test_a_commit_reads_the_record_it_replaces_whatever_its_spelling(
        rec: Record, spelling: str) -> None:
    # ``encoded`` is the fast path's spelling; JSON with spaces (and a dtype name that
    # needs escaping) goes through the full decoder: the same numbers either way.
    raw = rec.encode() if spelling == "encoded" else json.dumps(vars(rec)).encode()
    assert _replaced_of(raw) == (rec.nbytes, rec.version, rec.seg, rec.off, rec.length)
