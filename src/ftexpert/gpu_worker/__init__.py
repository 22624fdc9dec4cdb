"""GPU worker: dense model, KV cache, expert slot cache, copy streams, CUDA graphs."""
