"""What a step optimizes, on device: SFT / PPO / GSPO losses, path sums, log-probs through the output head, advantages, the critic, and the objective assembled from them."""
