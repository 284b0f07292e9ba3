"""Sampling from the policy: the KV-cache sampler, rollouts with their routes, the vLLM engine, evaluation."""
