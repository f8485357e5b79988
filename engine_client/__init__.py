"""What runs inside an engine: the daemon client (here), the connector (``engine_client.connector``,
the engine API), KV layouts and transfers, and the reference cache manager built on the connector."""

from engine_client.channel import DaemonDown, DaemonError, DaemonUnavailable
from engine_client.client import KVCacheClient, connect
from engine_client.connection import Connection, ConnectionState
from proto.messages import KVGeometry
from proto.replies import AcquireReply, AttachInfo, LookupReply

__all__ = ["AttachInfo", "Connection", "ConnectionState", "DaemonDown", "DaemonError", "DaemonUnavailable",
           "KVCacheClient", "KVGeometry", "LookupReply", "AcquireReply", "connect"]
