"""apollo_py.distributed on a two-node Ray cluster on the loopback address (``make distributed``).

The head (``ray start --head``) and a worker node (``ray start --address``) run as separate
processes with one CPU each, so the two data-parallel workers and the two inference actors land
on different nodes and the collective and the shipped pieces cross between raylets.  Each
``ray start`` runs with ``--block`` and is stopped by its process id at the end (a plain
``ray stop`` would stop every Ray on the machine, other users' too); the test then checks that
no process of this cluster (marked by its temp dir) is left.
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import apollo_py as ap  # noqa: E402
from apollo_py.distributed import DataParallel, predict  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))   # one MLP for both suites
from mlp_models import mlp_onnx, mlp_weights  # noqa: E402

# ~1 min of cluster start-up and teardown: run by `make distributed`, not by `make test`
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("APOLLO_PY_CLUSTER_TEST") != "1",
                                 reason="two-node cluster test: `make distributed` "
                                        "(APOLLO_PY_CLUSTER_TEST=1)")]
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _our_processes(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


@pytest.fixture(scope="module")
def cluster():
    temp = tempfile.mkdtemp(prefix="apray")   # short: Ray's socket paths have a length limit
    port = _free_port()
    # loopback only: no token authentication (a real cluster keeps Ray's default, see README)
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    common = ["--num-cpus=1", "--node-ip-address=127.0.0.1", "--block", f"--temp-dir={temp}"]
    head = subprocess.Popen([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false",
                             *common], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    procs = [head]
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while subprocess.run([RAY, "status", f"--address={address}"], env=env,
                             capture_output=True).returncode != 0:
            if time.monotonic() > deadline or head.poll() is not None:
                pytest.fail("the Ray head did not start within 90 s")
            time.sleep(1)
        procs.append(subprocess.Popen([RAY, "start", f"--address={address}", *common], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            if time.monotonic() > deadline:
                pytest.fail("the worker node did not join within 90 s")
            time.sleep(0.5)
        yield address
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
        for p in reversed(procs):   # each `ray start --block` stops its node's processes
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        deadline = time.monotonic() + 30
        while _our_processes(temp) and time.monotonic() < deadline:
            time.sleep(1)
        left = _our_processes(temp)
        for line in left:   # by id, only this cluster's processes
            os.kill(int(line.split()[0]), signal.SIGKILL)
        assert not left, f"processes of the test cluster were left behind: {left}"


def test_two_node_cluster_trains_and_predicts_like_one_process(cluster):
    model = mlp_onnx(mlp_weights((32, 24, 10)))
    rng = np.random.default_rng(2)
    batches = [(rng.standard_normal((256, 32)).astype(np.float32), rng.integers(0, 10, 256))
               for _ in range(20)]
    opt = ap.optim.Adam(1e-2)
    ref = ap.train_step(model, optimizer=opt)
    for x, y in batches:
        ref(labels=y, x=x)
    with DataParallel(ap.train_step(model, optimizer=opt), 2) as dp:
        nodes = {ray.get(w.node.remote()) for w in dp._workers}
        dp.fit([{"labels": y, "x": x} for x, y in batches])
        sd = dp.state_dict(1)
    assert len(nodes) == 2, "the two workers should run on the two nodes"
    for k in ref.params:
        np.testing.assert_allclose(sd["params"][k], ref.params[k], rtol=1e-5, atol=1.2e-7, err_msg=k)

    x = rng.standard_normal((64, 32)).astype(np.float32)
    ds = ray.data.from_items([{"id": i, "x": x[i]} for i in range(len(x))])
    rows = predict(ds, model, num_actors=2, batch_size=16, example={"x": x[:16]}).take_all()
    f = ap.jit(model)
    want = np.concatenate([f(x[i:i + 16]) for i in range(0, len(x), 16)])
    assert [r["id"] for r in rows] == list(range(len(x)))
    np.testing.assert_allclose(np.stack([r["logits"] for r in rows]), want, rtol=1e-6, atol=1e-6)
