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
