"""Cache directories packed into a dict and written into another (no Ray needed)."""
import numpy as np

import apollo_py as ap
from apollo_py.distributed.pieces import pack, unpack


def test_shipped_pieces_make_a_cold_cache_compile_a_hit(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    b = ap.GraphBuilder("g")
    x = b.input("x", (4, 8))
    g = b.build([b.exp(x) * 2.0])
    a = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    want = ap.jit(g, options=ap.Options(cache_dir=str(src)))(a)
    files = pack(str(src))
    assert any(k.startswith("pieces/") and k.endswith(".piece") for k in files)
    (dst / "machine.json").parent.mkdir(parents=True)
    (dst / "machine.json").write_text("{}")   # this node's own file is kept
    files_evil = dict(files, **{"../outside.bin": b"x"})
    written = unpack(files_evil, str(dst))
    assert written == len(files) - ("machine.json" in files)
    assert (dst / "machine.json").read_text() == "{}"
    assert not (tmp_path / "outside.bin").exists()
    assert unpack(files, str(dst)) == 0          # already there: nothing rewritten
    from apollo_py.cache import PieceCache
    cache = PieceCache(str(dst))
    keys = [k.rsplit("/", 1)[1][:-len(".piece")] for k in files if k.endswith(".piece")]
    assert all(cache.get(k) is not None for k in keys)   # checksums hold after the trip
    np.testing.assert_allclose(ap.jit(g, options=ap.Options(cache_dir=str(dst)))(a), want, rtol=1e-6)
