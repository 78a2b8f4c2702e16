"""Machine figures (apollo_py/machine.py): pinned, preset, measured and stored; what a noisy
measurement leaves behind; the ``apollo-py machine`` command."""
import json

import pytest

import apollo_py as ap
from apollo_py import machine as M
from apollo_py.cli import main


@pytest.fixture(autouse=True)
def _fresh_memo():
    M._MEASURED.clear()
    yield
    M._MEASURED.clear()


def test_presets_and_pinned_figures_resolve_as_given():
    assert M.resolve_machine(ap.Options(machine="slow")) == M.Machine(bandwidth=5e9, peak=20e9)
    assert M.resolve_machine(ap.Options(machine="fast")).bandwidth == 200e9
    mine = ap.Machine(bandwidth=3e9, peak=7e9, launch=2e-6, inline_bytes=1024)
    assert M.resolve_machine(ap.Options(machine=mine)) is mine
    # provenance takes no part in equality, so a pinned copy of a preset is the same machine
    assert mine.replace(source="elsewhere") == mine


@pytest.mark.parametrize("bad", [dict(machine="bogus"), dict(machine=3.0)])
def test_bad_machine_option_names_the_choices(bad):
    with pytest.raises(ap.OptionsError, match="preset|Machine"):
        ap.Options(**bad)


@pytest.mark.parametrize("field,value", [("bandwidth", 0), ("peak", -1.0), ("launch", float("nan")),
                                         ("chunk_bytes", 0), ("bandwidth", "fast")])
def test_machine_rejects_impossible_figures(field, value):
    kw = dict(bandwidth=1e9, peak=1e9)
    kw[field] = value
    with pytest.raises(ap.OptionsError, match=field):
        ap.Machine(**kw)


def test_hardware_report_is_sane():
    hw = M.hardware()
    assert hw["cores"] >= 1 and hw["vector_bytes"] in (16, 32, 64)
    assert all(isinstance(v, int) and v >= 0 for v in hw["caches"].values())


def test_measurement_is_best_of_rounds_and_recorded():
    m = M.measure_machine(rounds=3, attempts=1)
    assert m.source == "measured" and m.bandwidth >= M.MIN_BANDWIDTH and m.peak > 0
    (attempt,) = m.notes["attempts"]
    assert attempt["bandwidth"] == m.bandwidth and attempt["peak"] == m.peak
    assert set(attempt["spread"]) == {"bandwidth", "peak"}
    assert 0 <= attempt["spread"]["bandwidth"] < 1
    assert m.notes["hardware"] == M.hardware()
    assert attempt["peak_from"].startswith("numpy 512^3 sgemm (no probe")


def test_compiler_measures_the_peak_with_the_fma_loop():
    from apollo_py.codegen.fma_peak import peak_probe
    m = M.measure_machine(rounds=2, attempts=1, probe=peak_probe)
    (attempt,) = m.notes["attempts"]
    assert attempt["peak_from"].startswith("fma loop") and attempt["peak"] == m.peak > 0


def test_fma_peak_uses_the_widest_vectors_and_beats_numpy_sgemm():
    """The peak comes from the generated FMA loop on the widest vectors the host executes; on
    one thread, by CPU time, it is at least what numpy's sgemm reaches (whatever kernel the
    BLAS build picked: the loop does nothing but FMAs)."""
    import time

    import numpy as np

    from apollo_py.codegen import fma_peak
    from apollo_py.codegen.llvm import host
    feats = host().features.split(",")
    assert fma_peak.lanes() == (16 if "+avx512f" in feats else 8 if "+avx2" in feats and "+fma" in feats else 4)
    one = max(fma_peak.fma_rate(1) for _ in range(3))
    a = np.ones((256, 256), np.float32)
    best = 0.0
    for _ in range(5):
        t = time.process_time()
        for _ in range(20):
            a @ a
        best = max(best, 20 * 2 * 256 ** 3 / max(time.process_time() - t, 1e-9))
    # process time counts every BLAS thread: the sum of their rates, at most cores x one thread
    assert one * M.hardware()["cores"] >= 0.8 * best


@pytest.mark.parametrize("lanes,chains,fma", [(8, 12, True), (4, 8, False)])
def test_fma_peak_loop_for_narrower_machines_is_valid_ir(lanes, chains, fma):
    from apollo_py.codegen import fma_peak
    from apollo_py.codegen.llvm import host
    mod = host().llvm.parse_assembly(fma_peak._ir(lanes, chains, fma, ""))
    mod.verify()
    assert "apollo_fma_peak" in str(mod)


def _fake_attempts(monkeypatch, attempts):
    """Make measure_machine see ``attempts`` (figures, spreads) one after another."""
    it = iter(attempts)

    def once(hw, rounds):
        bw, pk, spread = next(it)
        return {"bandwidth": bw, "peak": pk, "spread": {"bandwidth": spread, "peak": spread},
                "working_set_bytes": 1}
    monkeypatch.setattr(M, "_measure_once", once)
    monkeypatch.setattr(M.time, "sleep", lambda s: None)


def test_noisy_attempts_are_measured_again_and_best_kept(monkeypatch):
    hw = M.hardware()
    good_peak = max(M.peak_bound(hw), 1e9)
    _fake_attempts(monkeypatch, [(10e9, good_peak, 0.6), (30e9, good_peak / 2, 0.01)])
    m = M.measure_machine()
    assert len(m.notes["attempts"]) == 2 and m.notes["problems"] == []
    assert m.bandwidth == 30e9 and m.peak == good_peak


def test_implausible_figures_are_used_but_not_stored(monkeypatch, tmp_path):
    if not M.peak_bound(M.hardware()):
        pytest.skip("the OS reports no clock: the peak cannot be checked")
    _fake_attempts(monkeypatch, [(20e9, 1e6, 0.0)] * M.MAX_ATTEMPTS)
    m = M.measured_machine(str(tmp_path))
    assert "implausible" in m.source and m.notes["problems"]
    assert not (tmp_path / "machine.json").exists()      # the next process measures again
    assert M.resolve_machine(ap.Options(cache_dir=str(tmp_path))) is m   # once per process


def test_stored_figures_are_reused_until_the_hardware_changes(monkeypatch, tmp_path):
    _fake_attempts(monkeypatch, [(20e9, max(M.peak_bound(M.hardware()), 1e9), 0.0)] * 3)
    first = M.measured_machine(str(tmp_path))
    assert first.source.startswith("measured, saved to")
    M._MEASURED.clear()
    again = M.measured_machine(str(tmp_path))
    assert again.source.startswith("cached:") and again == first
    # another CPU behind the same cache dir (a shared home): stale, measured anew
    data = json.loads((tmp_path / "machine.json").read_text())
    data["notes"]["hardware"]["cores"] += 1
    (tmp_path / "machine.json").write_text(json.dumps(data))
    M._MEASURED.clear()
    assert M.load_machine(str(tmp_path)) is None
    # an older format (three bare figures, measured once) is not trusted either
    (tmp_path / "machine.json").write_text(json.dumps({"bandwidth": 1e9, "peak": 1e9, "launch": 1e-5}))
    assert M.load_machine(str(tmp_path)) is None


def test_cli_shows_figures_and_their_source(tmp_path, capsys):
    assert main(["machine", "--preset", "slow", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["figures"]["bandwidth"] == 5e9 and shown["source"] == "preset:slow"
    M.save_machine(str(tmp_path), ap.Machine(bandwidth=12e9, peak=34e9,
                                             notes=M.measure_machine(rounds=1, attempts=1).notes))
    assert main(["--cache-dir", str(tmp_path), "machine"]) == 0
    out = capsys.readouterr().out
    assert "12.0 GB/s" in out and "34.0 GFLOP/s" in out and f"cached:{tmp_path}" in out
    assert main(["--cache-dir", str(tmp_path), "machine", "--reset", "--preset", "fast"]) == 0
    assert not (tmp_path / "machine.json").exists()
    assert main(["machine", "--preset", "nope"]) == 2
