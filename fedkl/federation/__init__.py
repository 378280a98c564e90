"""The federation layer: the queries an algorithm asks users (:mod:`fedkl.federation.base`) and the backends that
answer them (in-process, Ray shards; the Flower ones are in :mod:`fedkl.flower`). A regular package so that
documentation tools find its modules; it imports nothing."""
