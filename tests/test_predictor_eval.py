"""`hintserve predictor eval` and friends: request-level splits, the timing model, outputs, CLI errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services import cli
from services.predictor.eval import EvalConfig, fetch_rate, run_eval, split_by_request
from services.predictor.traces import save_traces
from tests.test_predictor_predictors import synthetic_trace

ROW_KEYS = {"predictor", "distance", "exact_hit", "at_least_one", "recall_at_budget", "budget", "n_predictions",
            "goodpred", "fetch_rate"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_split_is_by_request_and_disjoint() -> None:
    requests = synthetic_trace(requests=10, iterations=2).requests
    (train, test), = split_by_request(requests, EvalConfig(test_fraction=0.3))
    assert len(test) == 3 and not {r.request_id for r in train} & {r.request_id for r in test}
    folds = split_by_request(requests, EvalConfig(folds=3))
    tested = [r.request_id for _, te in folds for r in te]
    assert sorted(tested) == sorted(r.request_id for r in requests)  # every request tested exactly once
    for tr, te in folds:
        assert not {r.request_id for r in tr} & {r.request_id for r in te}
    assert split_by_request(requests, EvalConfig(seed=1)) == split_by_request(requests, EvalConfig(seed=1))
    with pytest.raises(ValueError, match="at least 2 requests"):
        split_by_request(requests[:1], EvalConfig())


def test_fetch_rate_model() -> None:
    assert fetch_rate(1, 2, layer_ms=1.0, expert_ms=0.5, predict_ms=0.2) == 0.5  # one of two fits in 0.8 ms
    assert fetch_rate(2, 2, 1.0, 0.5, 0.2) == 1.0  # a longer stride hides the transfer
    assert fetch_rate(4, 4, 1.0, 0.5, 0.0) == 0.5  # the link moves 2 experts per layer, whatever the stride
    assert fetch_rate(1, 1, 1.0, 2.0) == 0.0


def test_run_eval_rows_and_report(tmp_path) -> None:
    from services.predictor.eval import write_report

    trace = synthetic_trace(requests=8, iterations=6)
    cfg = EvalConfig(distances=[1, 3], folds=2)
    payload = run_eval([trace], ["t"], trace, "t", ["random", "previous-token", "popularity-affinity"], cfg,
                       progress=False)
    rows = payload["rows"]
    assert len(rows) == 6 and all(ROW_KEYS <= set(r) for r in rows)
    assert sum(len(te) for te in payload["split"]["test_requests"]) == 8
    by = {(r["predictor"], r["distance"]): r for r in rows}
    assert all(r["n_predictions"] == 8 * 6 * 4 for r in rows)  # every test request once, every layer
    assert by[("popularity-affinity", 1)]["exact_hit"] > 0.6 > 0.2 > by[("random", 1)]["exact_hit"]
    assert 0 <= by[("random", 3)]["goodpred"] <= by[("random", 3)]["recall_at_budget"]
    written = write_report(payload, str(tmp_path / "out.json"), "synthetic")
    assert json.load(open(written[0]))["rows"] == json.loads(json.dumps(rows))
    assert "| popularity-affinity |" in open(written[1]).read()


def test_cli_eval_train_collect_end_to_end(tmp_path, capsys) -> None:
    trace = synthetic_trace(requests=6, iterations=4)
    save_traces(trace, str(tmp_path / "trace"))
    out = tmp_path / "res" / "r.json"
    rc = cli.main(["predictor", "eval", "--train", str(tmp_path / "trace"), "--test", str(tmp_path / "trace"),
                   "--predictors", "previous-token,expert-map", "--distance", "1,2", "--json", str(out)])
    assert rc == 0
    payload = json.loads(out.read_text())
    assert {r["predictor"] for r in payload["rows"]} == {"previous-token", "expert-map"}
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").stat().st_size > 1000
    assert payload["split"]["same_file"] and "plan_size" in payload["rows"][-1]
    model = tmp_path / "mlp.pt"
    rc = cli.main(["predictor", "train", "--trace", str(tmp_path / "trace"), "--out", str(model), "--epochs", "2",
                   "--width", "128", "--holdout", "0.34"])
    assert rc == 0 and model.stat().st_size > 0
    from services.predictor.predictors.expert_mlp import ExpertMLPPredictor

    assert ExpertMLPPredictor.load(str(model)).num_experts == 8


def test_cli_trace_collect(tiny_mixtral_dir: str, tmp_path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\ndef f(x):\n")
    rc = cli.main(["trace", "collect", "--model", tiny_mixtral_dir, "--prompts", str(prompts), "--out",
                   str(tmp_path / "t"), "--max-tokens", "2", "--batch", "2"])
    assert rc == 0
    index = json.loads((tmp_path / "t" / "index.json").read_text())
    assert index["num_iterations"] == 4 and len(index["requests"]) == 2
    assert set(np.load(tmp_path / "t" / "trace.npz").files) >= {"probs", "counts", "embedding"}


@pytest.mark.parametrize("argv, message", [
    (["predictor", "eval", "--train", "{missing}", "--test", "{missing}", "--json", "{out}"], "trace not found"),
    (["predictor", "eval", "--train", "{trace}", "--test", "{trace}", "--json", "{out}", "--predictors", "nope"],
     "unknown predictor"),
    (["predictor", "eval", "--train", "{trace}", "--test", "{trace}", "--json", "{out}", "--distance", "0"],
     "--distance"),
    (["predictor", "train", "--trace", "{trace}", "--out", "{out}", "--holdout", "2"], "--holdout"),
    (["trace", "collect", "--model", "{missing}", "--prompts", "{missing}", "--out", "{out}"], "config.json"),
    (["predictor", "bench-search", "--capacity", "0"], "capacity"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, message, tmp_path, capsys) -> None:
    save_traces(synthetic_trace(requests=3, iterations=2), str(tmp_path / "trace"))
    subst = {"{missing}": str(tmp_path / "missing"), "{trace}": str(tmp_path / "trace"), "{out}": str(tmp_path / "o")}
    rc = cli.main([subst.get(a, a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0] and err[0].startswith("hintserve ")
