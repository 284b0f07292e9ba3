"""Route recording, Routing Replay and route comparison (DESIGN §2-§3)."""

from moe_rl.routing.compare import compare_routes, route_metrics, route_overlap
from moe_rl.routing.hooks import (
    MoeLayer, RoutedPass, RouteRecorder, RouteReplay, UnsupportedRouterError, find_moe_layers, router_margins,
)
from moe_rl.routing.routes import Routes, index_dtype

__all__ = [
    "MoeLayer",
    "RoutedPass",
    "RouteRecorder",
    "RouteReplay",
    "Routes",
    "UnsupportedRouterError",
    "compare_routes",
    "find_moe_layers",
    "index_dtype",
    "route_metrics",
    "route_overlap",
    "router_margins",
]
