"""The model files of a checkpoint and how they are read: config.json (every architecture), safetensors,
the quantized formats as published, the packed expert layout and the expert sources, dense weights, presets,
the tokenizer. The lowest layer of the GPU worker: it imports no other layer of it."""
