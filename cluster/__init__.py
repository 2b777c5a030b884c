"""Control plane: the radix tree, the head that owns it, and the client serving code holds."""

from hicache.cluster.client import CacheClient, EmbeddedTransport, embedded
from hicache.cluster.head import Call, CacheHead, CallResult, HeadConfig, Method

__all__ = ["Call", "CacheClient", "CacheHead", "CallResult", "EmbeddedTransport", "HeadConfig", "Method", "embedded"]
