"""Expert load balancing: the balancer (loads -> expert map), the sliding load window, the
rank-to-rank weight transfer and the rebalancer that runs them between two steps; and after lost
ranks, the survivors' map and the recovery of the experts only the lost ranks held."""

from moeserve.eplb.balancer import balance, imbalance
from moeserve.eplb.rebalancer import Rebalancer, RebalanceReport
from moeserve.eplb.recovery import Recovered, recover_layer
from moeserve.eplb.survivors import SlotSource, recovery_plan, survivor_map
from moeserve.eplb.transfer import move_experts, plan_layer
from moeserve.eplb.window import LoadWindow

__all__ = [
    "LoadWindow",
    "RebalanceReport",
    "Rebalancer",
    "Recovered",
    "SlotSource",
    "balance",
    "imbalance",
    "move_experts",
    "plan_layer",
    "recover_layer",
    "recovery_plan",
    "survivor_map",
]
