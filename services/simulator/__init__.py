"""Trace-driven discrete-event simulator for real-size MoE models (`hintserve simulate`).

Replays routing traces through the engine's own offload policy code (eviction, prefetchers, the offloaded
expert provider and the transfer engine's queue discipline) on simulated clocks: a compute timeline priced
from a model spec and a hardware profile, and a copy-engine timeline moving chunked expert transfers.
"""
