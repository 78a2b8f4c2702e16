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
    path = fresh._path(key)
    with open(path, "rb") as f:
        head = f.readline()
    with open(path, "wb") as f:
        f.write(head + b"garbage")
    assert PieceCache(str(tmp_path)).get(key) is None
    assert not os.path.exists(path)


def test_key_depends_on_everything():
    k = piece_key("abc", "cpu", {"tile": [32]})
    assert k != piece_key("abd", "cpu", {"tile": [32]})
    assert k != piece_key("abc", "c", {"tile": [32]})
    assert k != piece_key("abc", "cpu", {"tile": [64]})


def test_clear_and_info(tmp_path):
    c = PieceCache(str(tmp_path))
    c.put(piece_key("a", "c", {}), b"1", {})
    c.put(piece_key("b", "c", {}), b"22", {})
    assert c.info()["entries"] == 2 and c.info()["bytes"] > 3
    assert c.clear() == 2 and c.info()["entries"] == 0


def _age(c: PieceCache, key: str, seconds_ago: float) -> None:
    """Mark ``key``'s disk entry as last used ``seconds_ago`` (mtime resolution is not ours)."""
    import time
    t = time.time() - seconds_ago
    os.utime(c._path(key), (t, t))


def _entry_bytes(tmp_path, payload: int) -> int:
    """Bytes on disk of an entry with a ``payload``-byte payload (metadata line included)."""
    c = PieceCache(str(tmp_path / "probe"))
    c.put(piece_key("probe", "c", {}), bytes(payload), {})
    return os.path.getsize(c._path(piece_key("probe", "c", {})))


def test_disk_cap_evicts_least_recently_used(tmp_path):
    size = _entry_bytes(tmp_path, 300)
    cap = int(3.4 * size)
    c = PieceCache(str(tmp_path), max_bytes=cap)
    keys = [piece_key(str(i), "c", {}) for i in range(4)]
    for age, k in zip((40, 30, 20, 10), keys[:3]):
        c.put(k, bytes(300), {})
        _age(c, k, age)
    assert c.info()["entries"] == 3 and c.evictions == 0      # 3 entries: under the cap
    # a disk hit (from another process) makes keys[0] the most recently used
    assert PieceCache(str(tmp_path)).get(keys[0]) is not None
    c.put(keys[3], bytes(300), {})                            # 4 > 3.4 entries: evict to <= 3.06
    info = c.info()
    assert info["bytes"] <= 0.9 * cap and info["entries"] == 3 and c.evictions == 1
    fresh = PieceCache(str(tmp_path))
    assert fresh.get(keys[1]) is None                          # the oldest unused one went
    assert all(fresh.get(k) is not None for k in (keys[0], keys[2], keys[3]))


def test_disk_cap_counts_entries_written_by_other_processes(tmp_path):
    cap = int(2.5 * _entry_bytes(tmp_path, 400))
    other = PieceCache(str(tmp_path))
    for i in range(5):
        other.put(piece_key(f"o{i}", "c", {}), bytes(400), {})
        _age(other, piece_key(f"o{i}", "c", {}), 100 - i)
    c = PieceCache(str(tmp_path), max_bytes=cap)
    c.put(piece_key("mine", "c", {}), bytes(400), {})         # first write scans: 6 entries
    assert c.info()["bytes"] <= 0.9 * cap and c.evictions == 4
    assert c.get(piece_key("mine", "c", {})) is not None
