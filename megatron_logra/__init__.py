"""megatron_logra: memory-lean RL post-training on megatron-core with LoGRA and vLLM."""

from megatron_logra.runtime.lazy_wandb import keep_out_of_megatron as _keep_wandb_out

_keep_wandb_out()
