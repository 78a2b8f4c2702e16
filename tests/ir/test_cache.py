"""Piecewise cache: memory and disk hits, corrupt entries discarded, atomic files."""
import os

from apollo_py.cache import PieceCache, piece_key


def test_disk_roundtrip_and_corruption(tmp_path):
    c = PieceCache(str(tmp_path))
    key = piece_key("abc", "cpu", {"tile": [32]})
    assert c.get(key) is None
    c.put(key, b"\x7fELF-object", {"name": "k"})
    fresh = PieceCache(str(tmp_path))
    payload, meta = fresh.get(key)
    assert payload == b"\x7fELF-object" and meta["name"] == "k"
    assert fresh.disk_hits == 1
    # corrupt the payload: the entry is discarded, not returned
    bin_path = fresh._paths(key)[0]
    with open(bin_path, "wb") as f:
        f.write(b"garbage")
    assert PieceCache(str(tmp_path)).get(key) is None
    assert not os.path.exists(bin_path)


def test_key_depends_on_everything():
    k = piece_key("abc", "cpu", {"tile": [32]})
    assert k != piece_key("abd", "cpu", {"tile": [32]})
    assert k != piece_key("abc", "c", {"tile": [32]})
    assert k != piece_key("abc", "cpu", {"tile": [64]})


def test_clear_and_info(tmp_path):
    c = PieceCache(str(tmp_path))
    c.put(piece_key("a", "c", {}), b"1", {})
    c.put(piece_key("b", "c", {}), b"22", {})
    assert c.info()["entries"] == 2 and c.info()["bytes"] == 3
    assert c.clear() == 2 and c.info()["entries"] == 0
