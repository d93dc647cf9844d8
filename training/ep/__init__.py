"""Expert-parallel pieces: the all-to-all dispatcher and the DeepSpeed MoE adapter.

The public API is training.expert_parallel (setup_expert_parallel, EPHandle).
"""
