"""megatron_logra: memory-lean RL post-training on megatron-core with LoGRA and vLLM."""
