"""What runs inside an engine: the daemon client, the L1 pool and index, transfers, the cache manager."""

from engine_client.client import (AttachInfo, Connection, ConnectionState, DaemonDown, DaemonError,
                                  DaemonUnavailable, KVCacheClient, MatchReply, connect)
from proto.messages import KVGeometry

__all__ = ["AttachInfo", "Connection", "ConnectionState", "DaemonDown", "DaemonError", "DaemonUnavailable",
           "KVCacheClient", "KVGeometry", "MatchReply", "connect"]
