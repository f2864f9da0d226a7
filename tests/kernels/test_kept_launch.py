"""``kernels._launch.kept_launch``: the caller's key finds the kept launch and runs it on ``key[0]``'s stream;
no key or no kept launch goes through ``launch`` (CPU: a fake kernel records what runs)."""

from lowbit.kernels import _launch


class _Kernel:
    """Stands for a kernel that is not a JITFunction: ``launch`` calls ``fn[grid](*args, **kwargs)``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


class _Kept:
    def __init__(self):
        self.runs = []

    def run(self, device_index, *args):
        self.runs.append((device_index, args))


def test_a_kept_launch_runs_on_the_keyed_device():
    kept, fn = _Kept(), _Kernel()
    store = {(3, "k"): kept}
    assert _launch.kept_launch(store, (3, "k"), fn, (2,), ("a", 1), BLOCK=8) is kept
    assert kept.runs == [(3, ("a", 1))] and fn.calls == []


def test_no_key_or_no_kept_launch_goes_through_launch():
    fn, store = _Kernel(), {}
    assert _launch.kept_launch(store, None, fn, (2,), ("a",), BLOCK=8) is None
    assert _launch.kept_launch(store, (0, "other"), fn, (2,), ("b",), BLOCK=8) is None
    assert fn.calls == [((2,), ("a",), {"BLOCK": 8}), ((2,), ("b",), {"BLOCK": 8})]
    assert store == {}  # launch() kept nothing for a kernel it could not compile directly: nothing to store
