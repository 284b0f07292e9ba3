"""Route recording, Routing Replay and route comparison (DESIGN §2-§3)."""

from moe_rl.routing.compare import (
    MARGIN_EDGES, compare_routes, flip_margin_counts, route_metrics, route_overlap, router_shift,
)
from moe_rl.routing.hooks import (
    MoeLayer, RoutedPass, RouteRecorder, RouteReplay, UnsupportedRouterError, find_moe_layers, router_margins,
)
from moe_rl.routing.routes import Routes, index_dtype, load_snapshot

__all__ = [
    "MARGIN_EDGES",
    "flip_margin_counts",
    "router_shift",
    "MoeLayer",
    "RoutedPass",
    "RouteRecorder",
    "RouteReplay",
    "Routes",
    "UnsupportedRouterError",
    "compare_routes",
    "find_moe_layers",
    "index_dtype",
    "load_snapshot",
    "route_metrics",
    "route_overlap",
    "router_margins",
]
