#!/usr/bin/env python3
"""How many SnoozeML nodes keep model misses under a target, on paper.

Nodes share nothing; a consistent-hashing proxy (deploy/nginx/snooze.conf) sends each
model to one node. A node whose models all fit its memory never misses once warm; a
node given more than fit swaps them, least recently used first. This estimates, for N
nodes of M GiB each and a model mix (footprint, load time, request rate per model):

  * which models land on which node: nginx's own ring (160 points per node, CRC-32 of
    "host\\0port" + the previous point, the key's CRC-32 goes to the next point), for
    node addresses node-1:8080 .. node-N:8080 (or the ones given with --addresses);
  * each node's miss rate under LRU with Che's approximation: the characteristic time T
    solves  sum_i size_i * (1 - exp(-rate_i * T)) = budget,  and model i misses a
    fraction exp(-rate_i * T) of its requests;
  * the load time those misses cost each node per second (a node busy loading more than
    its own time is saturated: the misses grow without bound);
  * over `--rings` random address sets (the real addresses are not known in advance):
    the mean and worst miss rate, and the smallest N whose worst case meets the target.

The mix comes from a JSON file: {"models": [{"name", "rate", "footprint_bytes",
"load_seconds"}...]}, where footprint and load time may be omitted for a model that a
running node has measured: `--footprints STATE_DIR/footprints.json` (the learned
footprints file) fills them in. `--zipf S` spreads `--total-rate` over the models by a
Zipf law (rank = order in the file) instead of their own rates.

Che's approximation assumes independent requests (it is a per-request LRU model);
SnoozeML also lets queued requests of a resident model run before a swap, so measured
misses come out at or under the estimate (see deploy/README.md for the check against
the three-node nginx test).

    python3 deploy/capacity.py --mix deploy/mix.example.json --node-memory 8 --target-miss 1
"""

import argparse
import json
import math
import random
import sys
import zlib


def ring_owner(nodes, key):
    """The node nginx's `hash $key consistent` tries first (ngx_http_upstream_hash_module)."""
    points = []
    for n, server in enumerate(nodes):
        host, port = server.rsplit(":", 1)
        prev = 0
        for _ in range(160):
            prev = zlib.crc32(host.encode() + b"\0" + port.encode() + prev.to_bytes(4, "little"))
            points.append((prev, n))
    points.sort()
    h = zlib.crc32(key.encode())
    for p, n in points:
        if p >= h:
            return n
    return points[0][1]


def che_misses(models, budget):
    """Per model, the fraction of its requests that miss under LRU with `budget` bytes."""
    if sum(m["footprint_bytes"] for m in models) <= budget:
        return {m["name"]: 0.0 for m in models}

    def used(t):
        return sum(m["footprint_bytes"] * (1 - math.exp(-m["rate"] * t)) for m in models)

    lo, hi = 0.0, 1.0
    while used(hi) < budget and hi < 1e12:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if used(mid) < budget else (lo, mid)
    t = (lo + hi) / 2
    return {m["name"]: math.exp(-m["rate"] * t) for m in models}


def evaluate(models, nodes, budget):
    """(overall miss fraction, worst node's load seconds per second, per-node detail)."""
    homes = {m["name"]: ring_owner(nodes, m["name"]) for m in models}
    total_rate = sum(m["rate"] for m in models) or 1.0
    missed = 0.0
    detail = []
    busiest = 0.0
    for n, addr in enumerate(nodes):
        mine = [m for m in models if homes[m["name"]] == n]
        miss = che_misses(mine, budget)
        rate_missed = sum(m["rate"] * miss[m["name"]] for m in mine)
        loading = sum(m["rate"] * miss[m["name"]] * m["load_seconds"] for m in mine)
        busiest = max(busiest, loading)
        missed += rate_missed
        detail.append((addr, [m["name"] for m in mine], rate_missed, loading))
    return missed / total_rate, busiest, detail


def load_mix(args):
    with open(args.mix) as f:
        models = json.load(f)["models"]
    learned = {}
    if args.footprints:
        with open(args.footprints) as f:
            learned = json.load(f).get("footprints", {})
    if args.zipf is not None:
        weights = [(k + 1) ** -args.zipf for k in range(len(models))]
        for m, w in zip(models, weights):
            m["rate"] = args.total_rate * w / sum(weights)
    for m in models:
        l = learned.get(m["name"], {})
        m.setdefault("footprint_bytes", l.get("steady_bytes"))
        m.setdefault("load_seconds", l.get("load_seconds", args.default_load_seconds))
        if m.get("footprint_bytes") is None or m.get("rate") is None:
            sys.exit(f"model {m['name']}: needs footprint_bytes (or a learned footprint) and a rate")
    return models


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mix", required=True, help="JSON file: {\"models\": [{name, rate, footprint_bytes, load_seconds}]}")
    ap.add_argument("--footprints", help="a node's state_dir/footprints.json: measured footprints")
    ap.add_argument("--node-memory", type=float, required=True, help="memory budget of one node for models, GiB")
    ap.add_argument("--target-miss", type=float, default=1.0, help="target: percent of requests that miss")
    ap.add_argument("--max-nodes", type=int, default=32)
    ap.add_argument("--rings", type=int, default=50, help="random address sets per node count")
    ap.add_argument("--addresses", help="comma-separated node addresses (host:port): evaluate exactly these")
    ap.add_argument("--zipf", type=float, help="spread --total-rate over the models by Zipf(S), rank = file order")
    ap.add_argument("--total-rate", type=float, default=100.0, help="requests/s over all models, with --zipf")
    ap.add_argument("--default-load-seconds", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    models = load_mix(args)
    budget = args.node_memory * (1 << 30)

    if args.addresses:
        nodes = args.addresses.split(",")
        miss, busiest, detail = evaluate(models, nodes, budget)
        if args.json:
            print(json.dumps({"miss_percent": 100 * miss, "busiest_load_share": busiest,
                              "nodes": [{"address": a, "models": ms, "misses_per_s": r, "load_share": l}
                                        for a, ms, r, l in detail]}))
            return
        for addr, names, rate, loading in detail:
            print(f"{addr}: {names}  misses {rate:.2f}/s, loading {100 * loading:.0f}% of its time")
        print(f"miss rate {100 * miss:.2f}%")
        return

    rng = random.Random(args.seed)
    print(f"{len(models)} models, {sum(m['footprint_bytes'] for m in models) / (1 << 30):.1f} GiB in all, "
          f"{sum(m['rate'] for m in models):.1f} req/s; nodes of {args.node_memory:g} GiB; target misses "
          f"<= {args.target_miss:g}%")
    print(f"{'nodes':>5} {'mean miss %':>12} {'worst miss %':>13} {'worst node loading %':>21}")
    for n in range(1, args.max_nodes + 1):
        results = []
        for _ in range(args.rings):
            nodes = [f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}:8080" for _ in range(n)]
            miss, busiest, _ = evaluate(models, nodes, budget)
            # A node loading for more than all its time cannot keep up: count it as all-miss.
            results.append((1.0 if busiest >= 1.0 else miss, busiest))
        mean = sum(r[0] for r in results) / len(results)
        worst = max(r[0] for r in results)
        busiest = max(r[1] for r in results)
        print(f"{n:>5} {100 * mean:>12.2f} {100 * worst:>13.2f} {100 * min(busiest, 9.99):>21.0f}")
        if 100 * worst <= args.target_miss:
            print(f"=> {n} node(s) keep misses at or under {args.target_miss:g}% on every ring tried")
            return
    print(f"=> no node count up to {args.max_nodes} meets the target")


if __name__ == "__main__":
    main()
