"""Expert load balancing: the balancer (loads -> expert map), the sliding load window, the
rank-to-rank weight transfer and the rebalancer that runs them between two steps."""

from moeserve.eplb.balancer import balance, imbalance
from moeserve.eplb.rebalancer import Rebalancer, RebalanceReport
from moeserve.eplb.transfer import move_experts, plan_layer
from moeserve.eplb.window import LoadWindow

__all__ = ["LoadWindow", "RebalanceReport", "Rebalancer", "balance", "imbalance", "move_experts", "plan_layer"]
