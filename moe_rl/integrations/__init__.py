"""Integrations with outside training libraries, each behind its optional extra.

- `moe_rl.integrations.trl` (extra `trl`): Routing Replay (R2/R3) and the docs/design.md §3 route and ratio
  metrics inside TRL's `GRPOTrainer`.

Nothing is imported here, so `import moe_rl` never needs an optional dependency.
"""
