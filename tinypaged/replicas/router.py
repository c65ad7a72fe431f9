"""The KV-aware request router: a Ray Serve RequestRouter that sends a request to the replica whose prefix cache
holds the longest prefix of its prompt's blocks, balanced against each replica's queue and KV cache usage.

What each replica holds comes from its routing stats (`EngineReplica.record_routing_stats`: the keys of the block
hashes its engine has cached, replayed from the engine's prefix-cache events, published every
`request_routing_stats_period_s`). Between two publications the router also counts the prompts it has just
sent to a replica as held there: a chat's next turn usually comes before the blocks of its last turn are
published. Such a claim lasts until the replica publishes after the request completed (then its stats are the
truth, evictions included), or `claim_ttl_s`.

A conversation stays home: the replica holding the most of its own blocks (beyond the prefix every replica
holds, such as a shared system prompt) takes its request unless that replica is more than `max_imbalance`
requests above the least loaded one, or its KV cache is nearly full. A queue difference smaller than that is
transient (it turns over within a reply), while a conversation moved takes all its later turns with it: moving
early turns, whose history is only a few blocks, on such differences left one replica with more conversations
than the other for the rest of the run (benchmarks/HISTORY.md). Only where no replica holds more of the prompt
than the others (a new conversation, or one whose blocks were evicted everywhere; what an exact view of each
cache knows and a tree of past prompts does not) does the score decide.

Score of a replica, in blocks of prefill saved (what a request's time to first token is made of: the prefill of
the blocks it misses, and its wait for a place in the batch): matched blocks, less `running_cost_blocks` for
each ongoing request up to the replica's batch (`max_num_seqs`: they slow its steps a little), less
`waiting_cost_blocks` for each one beyond it (this one would wait for a slot behind them), less
`full_cost_blocks` when its KV cache is nearly full (admitting there would evict or preempt). A replica more
than `max_imbalance` requests above the least loaded one ranks last whatever it holds, so one hot prefix cannot
pile every request on one replica.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tinypaged.replicas.routing import RoutedRequest, longest_prefix

_FULL = 0.95  # KV cache usage above which a replica is nearly full


class KVAwareRouter(RequestRouter):
    """Longest cached prefix first, against queue depth and KV usage (the module docstring has the score)."""

    def initialize_state(
        self,
        running_cost_blocks: float = 0.5,
        waiting_cost_blocks: float = 2.0,
        full_cost_blocks: float = 16.0,
        max_imbalance: int = 5,
        claim_ttl_s: float = 120.0,
        decision_log: str | None = None,
    ) -> None:
        """The score's weights (request_router_kwargs). The defaults favour the cache strongly: measured on
        replicas sharing two CPU cores (benchmarks/replicas.py), where sending a request away from its blocks buys
        no compute and costs their prefill; replicas with GPUs of their own may want a higher waiting cost."""
        self.running_cost_blocks = running_cost_blocks
        self.waiting_cost_blocks = waiting_cost_blocks
        self.full_cost_blocks = full_cost_blocks
        self.max_imbalance = max_imbalance
        self.claim_ttl_s = claim_ttl_s
        self.decision_log = decision_log  # a path: one JSON line per decision, for a debug run
        # Per replica: the stats version its key set was built from, and the set.
        self._held: dict[ReplicaID, tuple[Any, frozenset[int]]] = {}
        # Per replica, per request routed there: its block keys, when it was routed, when it completed.
        self._claims: dict[ReplicaID, dict[str, tuple[frozenset[int], float, float | None]]] = {}

    def _held_keys(self, replica: RunningReplica) -> frozenset[int]:
        """The keys the replica published last (one set per publication, built once)."""
        stats = replica.routing_stats or {}
        version = (stats.get("published_at"), stats.get("version"))
        cached = self._held.get(replica.replica_id)
        if cached is None or cached[0] != version:
            cached = (version, frozenset(stats.get("block_keys", ())))
            self._held[replica.replica_id] = cached
        return cached[1]

    def _claimed_keys(self, replica: RunningReplica) -> set[int]:
        """Keys of requests sent to the replica that its last publication may not show yet."""
        claims = self._claims.get(replica.replica_id)
        if not claims:
            return set()
        published = (replica.routing_stats or {}).get("published_at", 0.0)
        now = time.time()
        keys: set[int] = set()
        for rid, (claim, routed_at, done_at) in list(claims.items()):
            if (done_at is not None and published > done_at) or now - routed_at > self.claim_ttl_s:
                del claims[rid]
            else:
                keys |= claim
        return keys

    def _load(self, replica: RunningReplica) -> int:
        """Ongoing requests: Ray's queue-length cache (kept fresh by its probes), else the published count."""
        queued = self._replica_queue_len_cache.get(replica.replica_id)
        if queued is None:
            queued = (replica.routing_stats or {}).get("num_requests", 0)
        return queued

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Every candidate ranked (balanced first, then home, then by score): the best alone first, then the
        rest in order."""
        if not candidate_replicas:
            return []
        route = pending_request.args[0] if pending_request is not None and pending_request.args else None
        keys = route.block_keys if isinstance(route, RoutedRequest) else ()
        loads = {r.replica_id: self._load(r) for r in candidate_replicas}
        least = min(loads.values())
        matches = {
            r.replica_id: longest_prefix(keys, self._held_keys(r), self._claimed_keys(r)) if keys else 0
            for r in candidate_replicas
        }
        # The conversation's own blocks (beyond the prefix every replica holds, a shared system prompt): where
        # the most of them are is its home.
        shared, most = min(matches.values()), max(matches.values())
        scored = []
        for r in candidate_replicas:
            stats = r.routing_stats or {}
            matched, usage = matches[r.replica_id], stats.get("kv_usage", 0.0)
            load, batch = loads[r.replica_id], stats.get("max_num_seqs", 256)
            waiting = max(0, load + 1 - batch)  # this request's place in the queue, if it would wait
            score = matched - self.running_cost_blocks * min(load, batch) - self.waiting_cost_blocks * waiting
            if usage > _FULL:
                score -= self.full_cost_blocks
            balanced = load - least <= self.max_imbalance
            home = most > shared and matched == most and usage <= _FULL
            # Ties: the lower KV usage, then the fewer blocks cached (so that new sessions spread), then chance.
            cached = len(self._held_keys(r)) + len(self._claimed_keys(r))
            scored.append((balanced, home, score, -usage, -cached, random.random(), r))
        scored.sort(key=lambda s: s[:6], reverse=True)
        ranked = [s[-1] for s in scored]
        if self.decision_log is not None:
            self._log_decision(pending_request, keys, scored)
        return [[ranked[0]], ranked[1:]] if len(ranked) > 1 else [ranked]

    def _log_decision(self, pending: PendingRequest | None, keys: tuple[int, ...], scored: list) -> None:
        """One decision as a JSON line: the request, then every replica as it was scored, the chosen first."""
        rid = pending.metadata.internal_request_id if pending is not None else None
        now = time.time()
        replicas = []
        for balanced, home, score, usage, size, _, r in scored:
            stats = r.routing_stats or {}
            held = longest_prefix(keys, self._held_keys(r))
            replicas.append(
                {
                    "replica": r.replica_id.unique_id,
                    "balanced": balanced,
                    "home": home,
                    "score": score,
                    "held": held,
                    "matched": longest_prefix(keys, self._held_keys(r), self._claimed_keys(r)),
                    "load": self._load(r),
                    "published_load": stats.get("num_requests"),
                    "kv_usage": -usage,
                    "cached": -size,
                    "stats_age_s": round(now - stats.get("published_at", now), 3),
                }
            )
        line = {"t": now, "request": rid, "blocks": len(keys), "replicas": replicas}
        with open(self.decision_log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Claim the request's blocks for the replica it went to, until the replica's stats show them."""
        route = pending_request.args[0] if pending_request.args else None
        if isinstance(route, RoutedRequest) and route.block_keys:
            rid = pending_request.metadata.internal_request_id
            self._claims.setdefault(replica_id, {})[rid] = (frozenset(route.block_keys), time.time(), None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request is done: its claim lasts until the replica publishes again."""
        claims = self._claims.get(replica_id)
        if claims and internal_request_id in claims:
            keys, routed_at, _ = claims[internal_request_id]
            claims[internal_request_id] = (keys, routed_at, time.time())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A dead replica's cache is gone with it."""
        self._held.pop(replica_id, None)
        self._claims.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)
