"""The control channel: node 0 publishes to every rank, every rank pushes back to node 0.

ZeroMQ sockets, not torch.distributed collectives: a rank waiting for the next step polls with
a short timeout, so an idle server holds no collective open (and none times out), and node 0
waiting for answers can notice a lost rank between polls instead of blocking in C++ until a
timeout. Messages are pickled objects (`messages.py`).
"""

from __future__ import annotations

import pickle
from typing import Any

import zmq


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class ControlServer:
    """Node 0's side: a PUB socket every rank subscribes to, a PULL socket they all push to.

    Both bind on `bind_host` at ports the OS picks; `addresses` is what ranks connect to
    (`advertise_host` is how other nodes reach this one).
    """

    def __init__(self, bind_host: str, advertise_host: str) -> None:
        self._context = zmq.Context()
        self._publisher = self._context.socket(zmq.PUB)
        self._publisher.setsockopt(zmq.LINGER, 0)
        self._publisher.setsockopt(zmq.SNDHWM, 0)  # never drop a step because ranks are slow
        self._collector = self._context.socket(zmq.PULL)
        self._collector.setsockopt(zmq.LINGER, 0)
        publish_port = self._publisher.bind_to_random_port(f"tcp://{bind_host}")
        collect_port = self._collector.bind_to_random_port(f"tcp://{bind_host}")
        self.addresses = (f"tcp://{advertise_host}:{publish_port}", f"tcp://{advertise_host}:{collect_port}")

    def publish(self, obj: Any) -> None:
        self._publisher.send(_dumps(obj), copy=False)

    def receive(self, timeout_s: float) -> Any | None:
        """The next message from any rank, or None if none came within `timeout_s`."""
        if self._collector.poll(int(timeout_s * 1000)):
            return pickle.loads(self._collector.recv(copy=False).buffer)
        return None

    def close(self) -> None:
        self._publisher.close()
        self._collector.close()
        self._context.term()


class ControlClient:
    """A rank's side: subscribed to node 0's publisher, pushing to its collector."""

    def __init__(self, publisher_address: str, collector_address: str) -> None:
        self._context = zmq.Context()
        self._subscriber = self._context.socket(zmq.SUB)
        self._subscriber.setsockopt(zmq.LINGER, 0)
        self._subscriber.setsockopt(zmq.RCVHWM, 0)
        self._subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        self._subscriber.connect(publisher_address)
        self._pusher = self._context.socket(zmq.PUSH)
        self._pusher.setsockopt(zmq.LINGER, 1000)  # a last report may still be in flight at exit
        self._pusher.connect(collector_address)

    def receive(self, timeout_s: float) -> Any | None:
        if self._subscriber.poll(int(timeout_s * 1000)):
            return pickle.loads(self._subscriber.recv(copy=False).buffer)
        return None

    def send(self, obj: Any) -> None:
        self._pusher.send(_dumps(obj), copy=False)

    def close(self) -> None:
        self._subscriber.close()
        self._pusher.close()
        self._context.term()
