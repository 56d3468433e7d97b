"""The main job: a Llama-architecture model over paged KV blocks (`model`, or SmolLM2's
weights in `smollm2`), multi-turn workloads (`workloads`), a continuous-batching serving loop
over the cache (`serving`) and the `demo` command (`cli`)."""

from .cli import main

__all__ = ["main"]
