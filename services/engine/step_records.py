"""One step's routing per request: what the predictor link publishes, the trace recorder stores and the
simulator's hint link replays, computed one way.

Per request of the step: token-mean router probabilities and routed-token counts of the layers routed so
far, and the mean input embedding. One device copy per array, then numpy over layers and requests (~0.1 ms
for a 32-layer decode step on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.common.messages import Shape, f32
from services.common.protos import predictor_pb2 as pb
from services.engine.step_context import StepContext


@dataclass
class StepRecords:
    layers: list[int]  # model layers routed among the first `layers_seen`, ascending (dense layers absent)
    probs: np.ndarray  # [requests, len(layers), experts] float32: token-mean router probabilities
    counts: np.ndarray  # [requests, len(layers), experts] float32: tokens routed to each expert (exact)
    embeddings: np.ndarray | None  # [requests, hidden] float32: token-mean input embedding; None: not recorded
    num_tokens: np.ndarray  # [requests]: the request's tokens in this step
    token_offsets: np.ndarray  # [requests + 1]: each request's rows in the step's token order


@torch.inference_mode()
def step_records(ctx: StepContext, layers_seen: int | None = None) -> StepRecords:
    """Records of the layers routed among the first `layers_seen` (None: every routed layer)."""
    n_req = len(ctx.request_ids)
    lens = np.asarray(ctx.seq_lens or [1] * n_req)
    token_req = np.repeat(np.arange(n_req), lens)  # request of each token, in batch order

    def per_request_sum(x: np.ndarray) -> np.ndarray:  # [tokens, ...] -> [requests, ...]
        if len(x) == n_req:  # decode: one token per request
            return x
        out = np.zeros((n_req, *x.shape[1:]), np.float32)
        np.add.at(out, token_req, x)
        return out

    def per_request_mean(x: np.ndarray) -> np.ndarray:
        if len(x) == n_req:
            return x
        return per_request_sum(x) / lens.reshape(-1, *([1] * (x.ndim - 1)))

    routed = sorted(ctx.router_probs) if layers_seen is None else range(layers_seen)
    layers = [i for i in routed if i in ctx.router_probs and i in ctx.selected_experts]
    if layers:
        n_exp = ctx.router_probs[layers[0]].shape[-1]
        probs = torch.stack([ctx.router_probs[i] for i in layers], dim=1).float().cpu().numpy()
        chosen = torch.stack([ctx.selected_experts[i] for i in layers], dim=1).cpu().numpy()
        onehot = np.zeros((chosen.shape[0], len(layers), n_exp), np.float32)  # [tokens, layers, experts]
        np.put_along_axis(onehot, chosen, 1.0, axis=2)
        probs, counts = per_request_mean(probs), per_request_sum(onehot)
    else:
        probs = counts = np.zeros((n_req, 0, 0), np.float32)
    emb = None
    if ctx.embeddings is not None:
        emb = per_request_mean(ctx.embeddings.float().cpu().numpy())
    offsets = np.concatenate([[0], np.cumsum(lens)])
    return StepRecords(layers, probs, counts, emb, lens, offsets)


def encode_step(ctx: StepContext, layers_seen: int, shape: Shape) -> list[pb.IterationContext]:
    """The step's records as the predictor service's IterationContexts: every model layer (dense and
    not-yet-routed layers stay zero), the embedding only when the shape has a hidden size."""
    records = step_records(ctx, layers_seen)
    n_req = len(ctx.request_ids)
    probs = np.zeros((n_req, shape.num_layers, shape.num_experts), np.float32)
    counts = np.zeros((n_req, shape.num_layers, shape.num_experts), np.float32)
    if records.layers:
        probs[:, records.layers] = records.probs
        counts[:, records.layers] = records.counts
    emb = records.embeddings if records.embeddings is not None and shape.hidden_size else np.zeros((n_req, 0))
    iterations = ctx.iterations or [0] * n_req
    return [
        pb.IterationContext(
            request_id=rid, iteration=iterations[i], layers_seen=layers_seen, num_tokens=int(records.num_tokens[i]),
            probs=f32(probs[i]), counts=f32(counts[i]), embedding=f32(emb[i]),
        )
        for i, rid in enumerate(ctx.request_ids)
    ]
