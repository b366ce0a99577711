"""``chatkv serve --ray``: the single server's app (``chatkv.server``) on N engine replicas under
Ray Serve, routed by session and cached prefix. Everything here is for ``--ray`` only; the
HTTP server itself lives one level up and never imports this package but for ``options``.

Modules: ``options`` (the ``--ray`` options and their checks; imports the rest lazily, once they
pass), ``deployments`` (the Ray Serve ingress and engine replicas, ``build``/``deploy``/``run``,
``app_builder`` for ``serve run``), ``request_routers`` (the Ray Serve ``RequestRouter``
classes), ``affinity`` (the routing policy without Ray: keys, what each replica holds, the
choice), ``asgi_call`` (one HTTP request answered by the app in-process, in a replica),
``prom_merge`` (one ``/metrics`` out of every replica's). Only ``deployments`` and
``request_routers`` import ray (the ``chatkv[ray]`` extra); this ``__init__`` imports nothing.

    serve run chatkv.server.ray.deployments:app_builder model=DIR replicas=2 db_url=URL data_dir=DIR
"""
