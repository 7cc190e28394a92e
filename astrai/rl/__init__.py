"""Online reinforcement learning: the trainer and the inference engine in one loop (GRPO with rollouts)."""
