"""moe_rl: routing stability of Mixture-of-Experts models under RL fine-tuning."""

__version__ = "0.1.0"
