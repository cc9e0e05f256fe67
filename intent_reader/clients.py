"""Redis clients for either deployment, one primary or Redis Cluster, and what differs
between them: the client class, the key layout that follows from it, the errors that mean
"not now" and how to find the topology again after a failover.

A cluster client (``redis.cluster.RedisCluster``, ``redis.asyncio.cluster.RedisCluster``)
sends each command to the primary that owns its key's slot, follows ``MOVED`` and ``ASK``
redirections, and groups a pipeline's commands by node: one round trip per node. The job
(``redis.cluster``) and the reader (``cluster=True``) make one from any node's address or
the configuration endpoint; the rest of the cluster is discovered from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
import redis.exceptions

from intent_reader.layout import DEFAULT_CLUSTER_SHARDS, DEFAULT_PREFIX, KeyLayout

SyncClient = redis.Redis | redis.cluster.RedisCluster
AsyncClient = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster

#: Errors that say Redis cannot be reached, or cannot serve the key now, and pass: a
#: dropped connection, a timeout, and on a cluster a failover in progress (``CLUSTERDOWN``,
#: a slot no node covers yet, redirections that did not settle, no reachable node).
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.RedisClusterException,
)

#: Error replies of a cluster in motion: the slot moved (``MOVED``), is being moved
#: (``ASK``, ``TRYAGAIN``) or has no primary for now (``CLUSTERDOWN``). The cluster client
#: follows the redirections itself; a reply still carrying one is retried later.
CLUSTER_MOTION_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ClusterDownError,
    redis.exceptions.AskError,  # MovedError is one
    redis.exceptions.TryAgainError,
)


def is_cluster(client: object) -> bool:
    """Whether ``client`` is a cluster client (either flavour)."""
    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


def layout_for(
    client: object, prefix: str = DEFAULT_PREFIX, shards: int | None = None
) -> KeyLayout:
    """The key layout to use over ``client``: ``shards`` slot groups when given (0: the
    single-node layout), else the cluster layout's default groups over a cluster client and
    the single-node layout over any other."""
    if shards is None:
        shards = DEFAULT_CLUSTER_SHARDS if is_cluster(client) else 0
    return KeyLayout(prefix, shards)


def sync_client(url: str, *, cluster: bool = False, **kwargs: Any) -> SyncClient:
    """A client of the Redis at ``url``: a cluster client with ``cluster``. ``kwargs`` are
    redis-py's (timeouts); a cluster client passes them to its connection to each node."""
    client: SyncClient = (
        redis.cluster.RedisCluster.from_url(url, **kwargs)
        if cluster
        else redis.Redis.from_url(url, **kwargs)
    )
    return client


def async_client(url: str, *, cluster: bool = False, **kwargs: Any) -> AsyncClient:
    """:func:`sync_client` for asyncio."""
    client: AsyncClient = (
        redis.asyncio.cluster.RedisCluster.from_url(url, **kwargs)
        if cluster
        else redis.asyncio.Redis.from_url(url, **kwargs)
    )
    return client


_PIPELINE_LOCKS: weakref.WeakKeyDictionary[Any, asyncio.Lock] = weakref.WeakKeyDictionary()


def pipeline_lock(client: AsyncClient) -> contextlib.AbstractAsyncContextManager[Any]:
    """Held while one pipeline (with its retries and topology reads) runs on an asyncio
    cluster client: one at a time per client. Two at once race while the topology is read
    again after a failover: one's ``aclose`` empties the default node another still reads
    (``AttributeError``), two reads of the startup nodes change one dict (``RuntimeError``),
    both seen with redis-py 5.3 (docs/decisions.md#cluster-pipelines-one-at-a-time). A
    plain client needs no lock (its pool gives each pipeline a connection)."""
    if not is_cluster(client):
        return contextlib.nullcontext()
    lock = _PIPELINE_LOCKS.get(client)
    if lock is None:
        lock = _PIPELINE_LOCKS[client] = asyncio.Lock()
    return lock


def is_unavailable(reply: object) -> bool:
    """Whether a pipeline's reply is an error that passes (:data:`UNAVAILABLE_ERRORS`, or
    :data:`CLUSTER_MOTION_ERRORS`) rather than an answer about the key."""
    return isinstance(reply, UNAVAILABLE_ERRORS + CLUSTER_MOTION_ERRORS)


def rediscover(client: SyncClient) -> None:
    """After a failover: drop idle connections (one primary behind an endpoint, which may now
    lead elsewhere), or read the cluster's topology again (a replica may own the slots now)."""
    if isinstance(client, redis.cluster.RedisCluster):
        with contextlib.suppress(*UNAVAILABLE_ERRORS):  # the next command tries again
            client.nodes_manager.initialize()
    else:
        client.connection_pool.disconnect(inuse_connections=False)


async def arediscover(client: AsyncClient) -> None:
    """:func:`rediscover` for asyncio. The cluster client's topology is replaced, not closed
    first: other coroutines may be sending on it."""
    if isinstance(client, redis.asyncio.cluster.RedisCluster):
        with contextlib.suppress(*UNAVAILABLE_ERRORS):  # the next command tries again
            await client.nodes_manager.initialize()
    else:
        await client.connection_pool.disconnect(inuse_connections=False)  # type: ignore[misc]  # redis-py types the asyncio pool's coroutine as optional
