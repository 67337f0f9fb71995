"""Expert load balancing: the balancer (loads -> expert map), the sliding load window, and the
live rebalance that moves expert weights between ranks."""

from moeserve.eplb.balancer import balance, imbalance

__all__ = ["balance", "imbalance"]
