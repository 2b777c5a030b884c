"""The reference client of the cache: a tiny JAX engine and the serving loop that drives it.

Not the cache: serving code of its own (an SGLang-JAX scheduler, say) uses ``import hicache`` only.
This package shows how a serving loop uses the cache API and gives the demo, the benchmarks and the
exactness tests a model whose KV is known bit for bit.

* ``engine/``: the model (``ModelRunner``: params + L1 pool + fixed-shape chunk forwards).
* ``engine_adapters``: the model as the scheduler sees it (in this process, in a worker).
* ``serve_types``: ``ServeRequest`` in, ``ServeResult`` (and its ``ServePhases``) out.
* ``scheduler``: ``Scheduler``, one request at a time (match, L3, load-back, prefill, decode, finish).
* ``serving_loop``: ``ServingLoop``, the iteration-level loop (SGLang's event loop) over a ``Scheduler``.
* ``ray_engine``: the engine inside a Ray replica's host workers (SPMD over every host).
* ``stack``: the embedded stack in one process (head + one HostWorker + engine + L3 directory).

Nothing is imported here: each module pulls in JAX (and ``ray_engine`` Ray) when it is imported.
"""
