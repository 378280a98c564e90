"""Test helper: record what every scheduled Gaussian release was given and what it released."""
from fedkl.privacy import Releaser


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
