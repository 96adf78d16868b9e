"""N engine replicas behind one OpenAI-compatible endpoint, on Ray Serve, with prefix-aware routing.

    args.py      --replicas, --ray-address, --routing-policy, --routing-imbalance-bound; how many fit
    routing.py   the three policies and the prefix index, pure Python (tested without Ray)
    router.py    the policies as Ray Serve's RequestRouter (the extension point, not a proxy of ours)
    replica.py   EngineReplica: one AsyncEngine per replica, streaming outputs to the ingress
    ingress.py   infer.server's app over a RemoteEngine (the same routes, errors and admission); /metrics
    app.py       the Serve application and `infer serve --replicas N` (the endpoint stays in this process)

Only router.py and app.py import Ray: `ray[serve]` is an optional extra (`pip install infer[ray]`),
imported by this path alone (the flags parse and the policies test without it).
"""
