"""The offload runtime: host expert store, device expert cache, transfer engine, policies and prefetchers."""
