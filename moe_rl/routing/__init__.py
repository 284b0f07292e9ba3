"""Route recording, Routing Replay and route comparison (docs/design.md §2-§3).

One job per module:
- `routes`: `Routes`, the (B, T, L, k) record of which experts each position used; save/load and
  the vLLM / SGLang route exports;
- `layers`: where the routers are (`find_moe_layers`), their shape and row order, and what is refused
  (`UnsupportedRouterError`);
- `gate_rules`: each family's gate-weight rule, and the check that picks the one a router computes;
- `hooks`: `RouteRecorder`, `RouteReplay` and `RoutedPass`, the context managers that use them;
- `compare`: route metrics between two `Routes` (flip rates, overlap, router shift, margins);
- `anchored`: every pass of a model takes the routes a frozen anchor model picks for the same tokens.
Nothing here imports `moe_rl.models`: models depend on routing, not the reverse.
"""

from moe_rl.routing.anchored import AnchoredRouting, anchored_by
from moe_rl.routing.compare import (
    MARGIN_EDGES,
    compare_routes,
    flip_margin_counts,
    route_metrics,
    route_overlap,
    router_shift,
)
from moe_rl.routing.hooks import RoutedPass, RouteRecorder, RouteReplay, router_margins
from moe_rl.routing.layers import MoeLayer, UnsupportedRouterError, find_moe_layers
from moe_rl.routing.routes import Routes, index_dtype, load_snapshot

__all__ = [
    "MARGIN_EDGES",
    "flip_margin_counts",
    "router_shift",
    "AnchoredRouting",
    "MoeLayer",
    "RoutedPass",
    "RouteRecorder",
    "RouteReplay",
    "Routes",
    "UnsupportedRouterError",
    "anchored_by",
    "compare_routes",
    "find_moe_layers",
    "index_dtype",
    "load_snapshot",
    "route_metrics",
    "route_overlap",
    "router_margins",
]
