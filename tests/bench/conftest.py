import pytest

from lowbit.bench.timing import Stats


class FakeTimer:
    """Stands in for CudaTimer on CPU: calls fn once per timing and reports fixed times."""

    def __init__(self, ms: float = 0.01):
        self.ms = ms
        self.calls = 0

    def time(self, fn):
        fn()
        self.calls += 1
        return Stats(ms=self.ms, p20=self.ms * 0.9, p80=self.ms * 1.1, n=10)

    def time_graph(self, fn):
        fn()
        return self.ms / 2

    def copy_bandwidth(self):
        return {"bytes": 2 << 30, "ms": 0.5, "GBps": (2 << 30) / 0.5 / 1e6}

    def launch_overhead(self):
        return {"eager_us": 5.0, "graph_us": 2.0}


@pytest.fixture
def fake_timer():
    return FakeTimer()
