"""ExpertMLP training (DuoServe section 4.2): dataset from traces, BCE, held-out split by request.

`ExpertMLPPredictor.fit` and `hintserve predictor train` (`services/predictor/train.py`) both call
`train_expert_mlp`. Popularity and affinity come from the training requests only.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from services.common.iteration_context import RequestTrace
from services.predictor.predictors.expert_mlp_net import MAX_DISTANCE, ExpertMLP, feature_dim, features
from services.predictor.predictors.popularity_affinity import PopularityAffinityPredictor


class ExpertMLPShape(Protocol):
    """What training reads and sets on the predictor (a Protocol, so this module need not import it)."""

    num_layers: int
    num_experts: int
    top_k: int
    first_width: int
    popaff: PopularityAffinityPredictor
    model: ExpertMLP


def split_requests(requests: list[RequestTrace], fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out) by request with a fixed seed; at least one request on each side when possible."""
    order = np.random.default_rng(seed).permutation(len(requests))
    n_out = min(max(1, round(fraction * len(requests))), len(requests) - 1) if len(requests) > 1 else 0
    held = {int(i) for i in order[:n_out]}
    return ([r for i, r in enumerate(requests) if i not in held], [r for i, r in enumerate(requests) if i in held])


def build_dataset(popaff: PopularityAffinityPredictor, requests: list[RequestTrace]) -> tuple[np.ndarray, np.ndarray]:
    """One sample per (decode iteration, target layer, distance 1..MAX_DISTANCE) with a distinct state."""
    L, E = popaff.num_layers, popaff.num_experts
    xs, ys = [], []
    for request in requests:
        for it in request.iterations:
            if it.num_tokens != 1:
                continue  # the predictor serves decode steps; a prefill's union of experts is another task
            label = (it.counts > 0).astype(np.float32)
            for t in range(L):
                for seen in sorted({max(0, t - d + 1) for d in range(1, MAX_DISTANCE + 1)}):
                    xs.append(features(popaff, it, seen, t))
                    ys.append(label[t])
    if not xs:
        return np.zeros((0, feature_dim(L, E)), np.float32), np.zeros((0, E), np.float32)
    return np.stack(xs), np.stack(ys)


def _topk_hit(model: nn.Module, x: np.ndarray, y: np.ndarray, k: int) -> float:
    with torch.no_grad():
        scores = model(torch.from_numpy(x)).numpy()
    top = np.argsort(-scores, axis=1)[:, :k]
    return float(np.take_along_axis(y, top, axis=1).sum(1).mean() / k)


def train_expert_mlp(pred: ExpertMLPShape, requests: list[RequestTrace], max_epochs: int = 20,
                     max_seconds: float = 40.0, holdout: float = 0.1, seed: int = 0, batch_size: int = 256,
                     lr: float = 1e-3, progress: bool = True) -> dict[str, Any]:
    """Fits pred.popaff and pred.model on `requests`; keeps the epoch with the best held-out BCE."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    train_reqs, held_reqs = split_requests(requests, holdout, seed)
    pred.popaff = PopularityAffinityPredictor(pred.num_layers, pred.num_experts, pred.top_k)
    pred.popaff.fit(train_reqs)
    x, y = build_dataset(pred.popaff, train_reqs)
    xh, yh = build_dataset(pred.popaff, held_reqs)
    if len(x) == 0:
        raise ValueError("no decode iterations to train the ExpertMLP on")
    model = ExpertMLP(feature_dim(pred.num_layers, pred.num_experts), pred.num_experts, pred.first_width)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.BCEWithLogitsLoss()
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    rng = np.random.default_rng(seed)
    best: tuple[float, dict] | None = None
    history = []
    start = time.monotonic()
    bar = tqdm(range(max_epochs), desc="expert-mlp", unit="epoch", disable=not progress)
    for epoch in bar:
        model.train()
        order = torch.from_numpy(rng.permutation(len(x)))
        for i in range(0, len(x) - 1, batch_size):
            idx = order[i:i + batch_size]
            if len(idx) < 2:
                continue  # BatchNorm needs two samples
            opt.zero_grad()
            loss = loss_fn(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
        model.eval()
        xe, ye = (xh, yh) if len(xh) else (x, y)
        with torch.no_grad():
            val = float(loss_fn(model(torch.from_numpy(xe)), torch.from_numpy(ye)))
        hit = _topk_hit(model, xe, ye, pred.top_k)
        history.append({"epoch": epoch + 1, "heldout_bce": val, "heldout_topk_recall": hit})
        bar.set_postfix(bce=f"{val:.4f}", recall=f"{hit:.3f}")
        if best is None or val < best[0]:
            best = (val, {k: v.clone() for k, v in model.state_dict().items()})
        if time.monotonic() - start > max_seconds:
            break
    assert best is not None
    model.load_state_dict(best[1])
    pred.model = model.eval()
    pred.popaff.fit(held_reqs)  # the deployed popularity/affinity use every training request
    return {"train_samples": len(x), "heldout_samples": len(xh), "train_requests": len(train_reqs),
            "heldout_requests": len(held_reqs), "epochs": history, "seconds": time.monotonic() - start,
            "best_heldout_bce": best[0], "max_distance": MAX_DISTANCE}
