"""docs/config.md is generated from moe_rl.config and names every key's meaning."""

from __future__ import annotations

from moe_rl.config_docs import PAGE, config_keys, missing_meanings, render


def test_config_page_is_current_and_complete() -> None:
    assert PAGE.read_text() == render(), "docs/config.md is stale: run `python -m moe_rl.config_docs`"
    assert missing_meanings() == []
    keys = [k for k, _ in config_keys()]
    assert {"optim.lr", "pass_at_k.k", "signal.no_signal_steps", "cold_start.patience", "keep_checkpoint"} <= set(keys)
    assert "| `cold_start.band` | `[0.2, 0.6]` |" in PAGE.read_text()
