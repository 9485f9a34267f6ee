"""`hintserve predictor eval`: every predictor on a train/test split by request, distances 1..D.

Protocol: fit on the training requests, then replay each test request in order, online: for every decode
iteration and every target layer t, query with the first s = max(0, t-d+1) layers of that iteration visible
(the rest masked out), then `observe` the finished iteration (the online stores learn from traffic as the
service would). Metrics per (predictor, distance): exact top-k hit (all k right), at-least-one hit, recall at
a budget of B experts per layer, and ProMoE's GoodPred = recall@B x FetchRate, where FetchRate comes from a
one-link timing model (`fetch_rate`). A test trace that is also a training trace is split by request (fixed
seed, optionally k-fold so every request is tested once); no request is ever in both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from services.common.iteration_context import IterationContext, PredictionQuery, RequestTrace, TracedIteration
from services.common.request_history import RequestHistory
from services.predictor.predictors import create_predictor, predictor_class, unavailable_reason
from services.predictor.traces import TraceSet


@dataclass
class EvalConfig:
    distances: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    budget: int | None = None  # experts fetched per layer; None = top_k
    layer_ms: float = 1.0  # time of one layer (attention + experts) during decode
    expert_ms: float = 0.5  # time to move one expert over the link
    predict_ms: float | None = 0.2  # predictor latency in the timing model; None = as measured here
    seed: int = 0
    test_fraction: float = 0.25
    folds: int = 1  # > 1: k-fold by request when the test trace is also a training trace
    include_prefill: bool = False
    online: bool = True  # test iterations are observed after being predicted (the stores learn from traffic)


def split_by_request(requests: list[RequestTrace], cfg: EvalConfig) -> list[tuple[list, list]]:
    """[(train, test)] by request with a fixed seed: one split, or `folds` disjoint test folds."""
    if len(requests) < 2:
        raise ValueError("a train/test split by request needs at least 2 requests in the trace")
    order = np.random.default_rng(cfg.seed).permutation(len(requests))
    if cfg.folds > 1:
        folds = [set(map(int, f)) for f in np.array_split(order, min(cfg.folds, len(requests)))]
    else:
        n_test = min(max(1, round(cfg.test_fraction * len(requests))), len(requests) - 1)
        folds = [set(map(int, order[:n_test]))]
    return [([r for i, r in enumerate(requests) if i not in f], [r for i, r in enumerate(requests) if i in f])
            for f in folds]


def fetch_rate(distance: int, budget: int, layer_ms: float, expert_ms: float, predict_ms: float = 0.0,
               layers: int = 64) -> float:
    """Share of predicted experts that arrive in time, steady state of a layer pipeline on one link.

    Layer g's `budget` experts can be requested once layer g-d has routed and the predictor answered
    ((g-d) * layer_ms + predict_ms) and are due when layer g starts (g * layer_ms); the link moves one expert
    per expert_ms, in target order; an expert that cannot arrive in time is not sent (cancelled).
    """
    free, hit, total = -np.inf, 0, 0
    for g in range(layers):
        requested, due = (g - distance) * layer_ms + predict_ms, g * layer_ms
        for _ in range(budget):
            done = max(free, requested) + expert_ms
            ok = done <= due + 1e-9
            if ok:
                free = done
            if g >= layers // 2:
                hit, total = hit + ok, total + 1
    return hit / max(total, 1)


def masked(it: IterationContext, seen: int) -> IterationContext:
    """`it` with only its first `seen` layers visible (what a predictor knows at that point)."""
    probs, counts = it.probs.copy(), it.counts.copy()
    probs[seen:] = 0.0
    counts[seen:] = 0.0
    out = TracedIteration(it.request_id, it.iteration, probs, counts, it.embedding, seen, it.num_tokens)
    if isinstance(it, TracedIteration) and it.layer_inputs is not None and it.token_experts is not None:
        out.layer_inputs = it.layer_inputs[:, :seen] if seen > 0 else it.layer_inputs[:, :0]
        out.token_experts = it.token_experts[:, :seen]
    return out


class _Acc:
    def __init__(self) -> None:
        self.n = 0
        self.exact = self.one = self.recall = 0.0
        self.plan_size = self.plan_recall = 0.0
        self.n_plan = 0

    def add(self, scores: np.ndarray, actual: np.ndarray, k: int, budget: int) -> None:
        order = np.argsort(-scores, kind="stable")
        hits_k = int(actual[order[:k]].sum())
        n_actual = max(int(actual.sum()), 1)
        self.n += 1
        self.exact += hits_k == min(k, n_actual)
        self.one += hits_k > 0
        self.recall += actual[order[:budget]].sum() / n_actual


def evaluate_predictor(name: str, train: TraceSet, test: list[RequestTrace], cfg: EvalConfig,
                       **kwargs) -> dict[int, dict[str, float]]:
    """Fits `name` on `train`, replays `test` online; metrics per distance."""
    pred = create_predictor(name, train, **kwargs)
    t0 = time.perf_counter()
    pred.fit(train.requests)
    fit_s = time.perf_counter() - t0
    L, k = train.num_layers, train.top_k
    budget = cfg.budget or k
    accs = {d: _Acc() for d in cfg.distances}
    predict_s, n_queries = 0.0, 0
    many = getattr(pred, "predict_many", None)
    plan = getattr(pred, "plan", None)
    for request in test:
        history = RequestHistory()
        for it in request.iterations:
            if it.iteration > 0 or cfg.include_prefill:
                views = {s: masked(it, s) for s in range(L)}
                keys = [(d, t) for d in cfg.distances for t in range(L)]
                queries = [PredictionQuery(history, views[max(0, t - d + 1)], t) for d, t in keys]
                t0 = time.perf_counter()
                scores = many(queries) if many else np.stack([pred.predict(q) for q in queries])
                predict_s += time.perf_counter() - t0
                n_queries += len(queries)
                for (d, t), q, sc in zip(keys, queries, scores):
                    actual = (it.counts[t] > 0).astype(np.float32)
                    accs[d].add(np.asarray(sc, np.float64), actual, k, budget)
                    if plan is not None:
                        experts = plan(q)[0]
                        accs[d].plan_size += len(experts)
                        accs[d].plan_recall += actual[experts].sum() / max(actual.sum(), 1)
                        accs[d].n_plan += 1
            if cfg.online:
                pred.observe(it)
            history.append(it)
    predict_ms = 1000 * predict_s / max(n_queries, 1)
    out = {}
    for d, a in accs.items():
        n = max(a.n, 1)
        latency = predict_ms if cfg.predict_ms is None else cfg.predict_ms
        rate = fetch_rate(d, budget, cfg.layer_ms, cfg.expert_ms, latency)
        row = {"exact_hit": a.exact / n, "at_least_one": a.one / n, "recall_at_budget": a.recall / n,
               "budget": budget, "fetch_rate": rate, "goodpred": a.recall / n * rate, "n_predictions": a.n,
               "predict_us": 1000 * predict_ms, "fit_s": fit_s}
        if a.n_plan:
            row.update(plan_size=a.plan_size / a.n_plan, plan_recall=a.plan_recall / a.n_plan)
        out[d] = row
    return out


def _merge(parts: list[dict[str, float]]) -> dict[str, float]:
    """Fold results weighted by their number of predictions."""
    total = sum(p["n_predictions"] for p in parts)
    merged = {key: sum(p[key] * p["n_predictions"] for p in parts) / max(total, 1) for key in parts[0]}
    merged["n_predictions"] = total
    merged["budget"] = parts[0]["budget"]
    merged["fit_s"] = sum(p["fit_s"] for p in parts)
    return merged


def run_eval(train: list[TraceSet], train_paths: list[str], test: TraceSet, test_path: str,
             predictors: list[str], cfg: EvalConfig, progress: bool = True, **kwargs) -> dict:
    """All predictors x distances. Returns the JSON payload (rows + what was split how)."""
    from tqdm import tqdm

    from services.predictor.trace_set import merge_traces

    same = [i for i, p in enumerate(train_paths) if p == test_path]
    others = [t for i, t in enumerate(train) if i not in same]
    if same:
        splits = split_by_request(test.requests, cfg)
    else:
        splits = [([], test.requests)]
    for t in others:
        if (t.num_layers, t.num_experts, t.top_k) != (test.num_layers, test.num_experts, test.top_k):
            raise ValueError("train and test traces have different shapes (layers, experts, top_k)")
    rows, skipped = [], {}
    results: dict[str, list[dict[int, dict]]] = {}
    for name in predictors:
        predictor_class(name)
        reason = unavailable_reason(name, test)
        if reason:
            skipped[name] = reason
    runnable = [p for p in predictors if p not in skipped]
    with tqdm(total=len(runnable) * len(splits), desc="predictor eval", unit="fit", disable=not progress) as bar:
        for fold_train, fold_test in splits:
            train_set = merge_traces(others + [test.subset(fold_train)]) if fold_train else merge_traces(others)
            assert not {r.request_id for r in fold_test} & {r.request_id for r in fold_train}
            for name in runnable:
                bar.set_postfix(predictor=name)
                results.setdefault(name, []).append(evaluate_predictor(name, train_set, fold_test, cfg, **kwargs))
                bar.update()
    for name in runnable:
        for d in cfg.distances:
            merged = _merge([fold[d] for fold in results[name]])
            rows.append({"predictor": name, "distance": d,
                         **{k: int(v) if k in ("n_predictions", "budget") else float(v) for k, v in merged.items()}})
    return {
        "train": train_paths, "test": test_path, "skipped": skipped,
        "trace": {"layers": test.num_layers, "experts": test.num_experts, "top_k": test.top_k,
                  "layer_ids": test.layer_ids, "requests": len(test.requests), "notes": test.notes},
        "split": {"by": "request", "seed": cfg.seed, "folds": len(splits), "same_file": bool(same),
                  "test_requests": [[r.request_id for r in te] for _, te in splits]},
        "config": {"distances": cfg.distances, "budget": cfg.budget or test.top_k, "layer_ms": cfg.layer_ms,
                   "expert_ms": cfg.expert_ms,
                   "predict_ms": "measured" if cfg.predict_ms is None else cfg.predict_ms, "online": cfg.online,
                   "include_prefill": cfg.include_prefill},
        "rows": rows,
    }


# ---- outputs ----------------------------------------------------------------------------------------

TABLE_KEYS = ("exact_hit", "at_least_one", "recall_at_budget", "goodpred")


def markdown_report(payload: dict, title: str) -> str:
    from services.common.report import markdown_table

    rows = payload["rows"]
    cfg, trace = payload["config"], payload["trace"]
    table = markdown_table(
        ["predictor", "d", "exact top-k", ">=1 hit", f"recall@{cfg['budget']}", "fetch rate", "GoodPred", "n",
         "us/query"],
        [[r["predictor"], r["distance"], *(f"{r[k]:.3f}" for k in (*TABLE_KEYS[:3], "fetch_rate", "goodpred")),
          r["n_predictions"], round(r["predict_us"])] for r in rows])
    names = list(dict.fromkeys(r["predictor"] for r in rows))
    dists = cfg["distances"]
    pivot = markdown_table(["predictor", *(f"d={d} exact / >=1" for d in dists)],
                           [[n, *(f"{r['exact_hit']:.3f} / {r['at_least_one']:.3f}" for d in dists
                                  for r in rows if r["predictor"] == n and r["distance"] == d)] for n in names])
    split = payload["split"]
    lines = [
        f"# {title}", "",
        f"Test: `{payload['test']}`; train: {', '.join(f'`{p}`' for p in payload['train'])}.",
        f"Trace: {trace['layers']} layers (ids {trace['layer_ids']}), {trace['experts']} experts, top-{trace['top_k']},"
        f" {trace['requests']} requests. {trace['notes']}",
        f"Split by request (seed {split['seed']}, {split['folds']} fold(s)); decode iterations only"
        f"{'' if not cfg['include_prefill'] else ' + prefill'}"
        f"{'' if cfg.get('online', True) else '; OFFLINE: test iterations are not observed'}. Budget {cfg['budget']} experts/layer; GoodPred ="
        f" recall@budget x fetch rate (layer {cfg['layer_ms']} ms, expert transfer {cfg['expert_ms']} ms,"
        f" predictor {cfg['predict_ms']} ms).",
    ]
    if payload["skipped"]:
        lines.append("Skipped: " + "; ".join(f"{k}: {v}" for k, v in payload["skipped"].items()) + ".")
    return "\n".join(lines) + "\n\n" + pivot + "\n\n" + table + "\n"


def plot_report(payload: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    names = list(dict.fromkeys(r["predictor"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), sharex=True)
    for ax, key, label in zip(axes, ("exact_hit", "at_least_one", "goodpred"),
                              ("exact top-k hit", "at-least-one hit", "GoodPred")):
        for n in names:
            pts = sorted((r["distance"], r[key]) for r in rows if r["predictor"] == n)
            style = dict(linewidth=2.8, color="black") if n == "hintserve" else dict(linewidth=1.4)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=n, **style)
        ax.set_title(label)
        ax.set_xticks(payload["config"]["distances"])
        ax.set_xlabel("prefetch distance (layers)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(payload: dict, json_path: str, title: str) -> tuple[str, str, str]:
    """JSON + markdown + PNG side by side (same stem). Returns the three paths."""
    import os

    from services.common.report import run_header, write_json

    stem = os.path.splitext(json_path)[0]
    payload = {**run_header(), "title": title, **payload}
    write_json(json_path, payload)
    with open(stem + ".md", "w") as f:
        f.write(markdown_report(payload, title))
    plot_report(payload, stem + ".png", title)
    return json_path, stem + ".md", stem + ".png"
