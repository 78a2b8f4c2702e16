"""The JSON-lines feedback log (feedback.log)."""
import json
import os
import threading

from apollo_py.feedback.log import default_log_path, log_event, read_events
from apollo_py.options import Options


def test_default_path_and_fields(tmp_path):
    opts = Options(cache_dir=str(tmp_path / "deep" / "cache"), model_name="bert")
    assert default_log_path(opts) == str(tmp_path / "deep" / "cache" / "feedback.jsonl")
    log_event(opts, "schedule_budget_exceeded", "sig", sizes={"x": [2, 3]}, time_ms=1.5,
              detail={"budget": 50})
    (e,) = read_events(default_log_path(opts))
    assert set(e) == {"event", "signature", "model", "sizes", "time_ms", "detail", "timestamp"}
    assert e["model"] == "bert" and e["sizes"] == {"x": [2, 3]} and e["detail"] == {"budget": 50}


def test_explicit_path_filter_and_concurrent_appends(tmp_path):
    path = str(tmp_path / "log" / "f.jsonl")
    opts = Options(feedback_path=path)

    def worker(k):
        for j in range(50):
            log_event(opts, "multiple_fusion_groups" if j % 2 else "tuning_result", f"s{k}",
                      detail="x" * 2000)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    with open(path) as f:
        lines = f.read().splitlines()
    assert len(lines) == 200 and all(json.loads(x)["detail"] == "x" * 2000 for x in lines)
    assert len(read_events(path, "tuning_result")) == 100


def test_missing_log_reads_empty(tmp_path):
    assert read_events(os.path.join(tmp_path, "none.jsonl")) == []
