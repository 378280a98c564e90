"""Test helper: record what every scheduled Gaussian release was given and what it released."""

from fedkl.privacy import Releaser


def charge_record(charge, **kw) -> dict:
    """What a stand-in ledger records of one typed charge: its mechanism, cost, sensitivity, noise
    scale, and the call's keywords (label, details)."""
    rho, eps, delta = charge.cost()
    return {
        "mechanism": charge.mechanism,
        "rho": rho,
        "eps": eps,
        "delta": delta,
        "sensitivity": charge.sensitivity,
        "noise_scale": charge.noise_scale,
        **kw,
    }


def record_schedule_releases(monkeypatch) -> list:
    """Patch ``Releaser.schedule_gaussian`` (for this test) so that every ``handle.release(value)``
    appends ``(value, released)`` to the returned list; ``released - value`` is the noise drawn."""
    pairs: list = []
    original = Releaser.schedule_gaussian

    def spy(self, **kw):
        handle = original(self, **kw)
        release = handle.release

        def recording(value):
            out = release(value)
            pairs.append((value.clone(), out.clone()))
            return out

        handle.release = recording
        return handle

    monkeypatch.setattr(Releaser, "schedule_gaussian", spy)
    return pairs


class KeyedNoise:
    """Deterministic stand-in for secure noise in crash-recovery tests (install with ``KeyedNoise(monkeypatch)``).

    Every :class:`~fedkl.privacy.rng.NoiseSource` handed to a Releaser draws its bits from a generator
    keyed by ``(salt(seq), where, seq)``: ``where`` is ``"in"`` for a draw inside release ``seq``'s
    sample and ``"out"`` for one made between releases (e.g. a Poisson cohort, keyed by the next seq).
    Set :attr:`salt` before each process: the same salt everywhere gives the uninterrupted run's noise;
    a recovering process given another salt at the seqs its first process journalled draws different
    ("fresh") bits there, as os.urandom would, and the same bits as the uninterrupted run everywhere
    else. So a correct recovery releases exactly the uninterrupted run's values (the first process's
    where they left it, fresh draws elsewhere), and one whose later noise depends on the re-drawn bits
    does not. :attr:`current` is the release being drawn (None between releases)."""

    def __init__(self, monkeypatch, salt: int = 1) -> None:
        import numpy as np

        from fedkl.privacy.rng import NoiseSource

        self.salt = lambda seq: salt
        self.current: int | None = None
        self._sources: dict[int, tuple] = {}  # id(source) -> (source, releaser, {key: generator})
        init, emit, raw = Releaser.__init__, Releaser._emit, NoiseSource._raw_uint64

        def spy_init(rel, ledger, noise, *a, **kw):
            init(rel, ledger, noise, *a, **kw)
            self._sources[id(noise)] = (noise, rel, {})
            rel._keyed_open = None

        def spy_emit(rel, seq, *a, **kw):
            rel._keyed_open, self.current = seq, seq
            try:
                return emit(rel, seq, *a, **kw)
            finally:
                rel._keyed_open, self.current = None, None

        def keyed_raw(source, n):
            known = self._sources.get(id(source))
            if known is None:
                return raw(source, n)
            _, rel, gens = known
            where, seq = ("in", rel._keyed_open) if rel._keyed_open is not None else ("out", rel.seq)
            key = (where, seq)
            if key not in gens:
                entropy = [int(self.salt(seq)), 0 if where == "in" else 1, int(seq)]
                gens[key] = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
            return gens[key].integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False)

        monkeypatch.setattr(Releaser, "__init__", spy_init)
        monkeypatch.setattr(Releaser, "_emit", spy_emit)
        monkeypatch.setattr(NoiseSource, "_raw_uint64", keyed_raw)
