"""``kernels._launch.kept_launch``: the caller's key finds the kept launch and runs it on ``key[0]``'s stream;
no key or no kept launch goes through ``launch`` (CPU: a fake kernel records what runs)."""

import pytest
import torch

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


# --- host descriptors: a bound launch encodes them itself, as Triton's wrapper would -------------------------------

_SIGNATURE = {"a": "*fp32", "x_desc": "tensordesc<bf16[64, 32]>", "n": "i32", "BLOCK": "constexpr"}


class _Run:
    """Stands for a compiled kernel's launcher: ``launch`` is Triton's own descriptor-expanding wrapper around a
    raw launcher that records what it receives."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, meta):
        driver = pytest.importorskip("triton.backends.nvidia.driver")
        self.raw_calls = []
        self.launch = driver.wrap_handle_tensordesc(lambda *a: self.raw_calls.append(a), _SIGNATURE, meta)


class _Compiled:
    function, packed_metadata = "fn-handle", "packed"

    def __init__(self, meta):
        self.run = _Run(meta)


@pytest.fixture
def encodings(monkeypatch):
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    made = []

    def fake(arg, meta):  # what make_tensordesc_arg returns, without a GPU: tagged by address and metadata
        made.append(arg.base.data_ptr())
        return [("tensormap", arg.base.data_ptr(), meta and meta["tag"]), *arg.shape, *arg.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", fake)
    return made


def _bound(meta):
    lc = _launch.Launch(None, (2, 1), {"BLOCK": 64}, 4)
    lc.compiled = ck = _Compiled(meta)
    lc._bind_c_launch(ck)
    return lc, ck


def _descriptor(t, block):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def _through_wrapper(ck, stream, args, tail):
    """What Triton's wrapper hands its raw launcher for these arguments (a real descriptor)."""
    before = len(ck.run.raw_calls)
    ck.run.launch(2, 1, 1, stream, ck.function, False, False, None, None, ck.packed_metadata, None, None, None,
                  *args, *tail)
    return ck.run.raw_calls[before]


def test_a_bound_launch_passes_what_tritons_wrapper_would(encodings):
    lc, ck = _bound([{"tag": "m0"}])
    assert [d[:2] for d in lc._desc] == [(1, {"tag": "m0"})]  # bound under the wrapper, to the raw launcher
    x = torch.zeros(128, 64, dtype=torch.bfloat16)
    a = torch.zeros(4)
    lc.run_on(7, a, _launch.LazyDescriptor(x, [64, 32]), 128)
    got = ck.run.raw_calls[-1]
    want = _through_wrapper(ck, 7, (a, _descriptor(x, [64, 32]), 128), (64,))
    assert got[13] is a and want[13] is a
    assert got[:13] == want[:13] and got[14:] == want[14:]
    assert got[14:] == (("tensormap", x.data_ptr(), "m0"), 128, 64, 64, 1, 128, 64)


def test_an_address_is_encoded_once_and_a_new_one_again(encodings):
    lc, ck = _bound([{"tag": "m0"}])
    x, y = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16)
    for t in (x, x, y, x):
        lc.run_on(0, None, _launch.LazyDescriptor(t, [64, 32]), 1)
    assert encodings == [x.data_ptr(), y.data_ptr()]
    assert [c[14][1] for c in ck.run.raw_calls] == [x.data_ptr(), x.data_ptr(), y.data_ptr(), x.data_ptr()]
    # other strides at the same address: another descriptor
    lc.run_on(0, None, _launch.LazyDescriptor(x[:, :32], [64, 32]), 1)
    assert encodings[-1] == x.data_ptr() and len(encodings) == 3 and ck.run.raw_calls[-1][15:19] == (128, 32, 64, 1)


def test_without_metadata_the_wrapper_stays(encodings):
    lc, ck = _bound(None)
    assert lc._desc == () and lc._c_launch is ck.run.launch  # Triton's wrapper does the expansion
    lc.run_on(0, None, _descriptor(torch.zeros(64, 32, dtype=torch.bfloat16), [64, 32]), 1)
    assert len(ck.run.raw_calls) == 1


def test_a_lazy_descriptor_becomes_tritons_where_triton_launches():
    pytest.importorskip("triton")
    from triton.tools.tensor_descriptor import TensorDescriptor

    fn = _Kernel()
    x = torch.zeros(128, 64, dtype=torch.bfloat16)
    _launch.launch(fn, (1,), (_launch.LazyDescriptor(x, [64, 32]), 3), BLOCK=8)
    (d, n), = [c[1] for c in fn.calls]
    assert type(d) is TensorDescriptor and n == 3
    assert (d.base is x, list(d.shape), list(d.strides), list(d.block_shape)) == (True, [128, 64], [64, 1], [64, 32])


def test_a_lazy_descriptor_with_a_layout_becomes_gluons():
    # a Gluon kernel's descriptor carries its shared-memory layout; the argument key tells layouts apart
    pytest.importorskip("triton.experimental.gluon")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    fn = _Kernel()
    x = torch.zeros(128, 64, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout.get_default_for([64, 32], gl.bfloat16)
    _launch.launch(fn, (1,), (_launch.LazyDescriptor(x, [64, 32], layout=layout), 3), BLOCK=8)
    (d, n), = [c[1] for c in fn.calls]
    assert type(d) is GluonDescriptor and d.layout == layout and n == 3
    assert (d.base is x, list(d.shape), list(d.strides), list(d.block_shape)) == (True, [128, 64], [64, 1], [64, 32])
    other = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    assert other != layout
    keys = {_launch._arg_key((_launch.LazyDescriptor(x, [64, 32], layout=lo),)) for lo in (layout, other, None)}
    assert len(keys) == 3
