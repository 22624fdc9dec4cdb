"""A trained MoE workload: corpus, tokenizer, Qwen3-MoE model and trainer (`train_moe`), Hugging Face
checkpoints (`checkpoint`), routing traces (`trace`) and statistics (`routing`). See docs/WORKLOAD.md."""
