"""Command-line tools: HF <-> megatron checkpoint conversion and verification."""
