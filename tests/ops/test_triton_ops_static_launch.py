"""The static-launch setting lowbit's triton_ops turn on for torch.compile reaches Inductor's compile workers:
they are separate processes that take the setting from the environment when they start, not from the parent's
``torch._inductor.config`` (Inductor hands them only its general static-launcher switch). A user's own
setting of the environment variable is left as it is."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
inductor_config = pytest.importorskip("torch._inductor.config")

from lowbit.ops import policy, triton_ops

ENV = triton_ops.STATIC_LAUNCH_ENV

READ_IN_CHILD = "import torch._inductor.config as c; print(c.static_launch_user_defined_triton_kernels)"


def _unset(monkeypatch) -> None:
    """The variable absent, and absent again after the test (a bare delenv of an absent variable would not
    undo what the test sets)."""
    monkeypatch.setenv(ENV, "placeholder")
    monkeypatch.delenv(ENV)


def _child_setting() -> str:
    return subprocess.run([sys.executable, "-c", READ_IN_CHILD], capture_output=True, text=True,
                          check=True, env=dict(os.environ)).stdout.strip()


@pytest.fixture
def setting_off():
    # Inductor's config module restores its own entries (monkeypatch would delete them on undo)
    with inductor_config.patch(static_launch_user_defined_triton_kernels=False):
        yield


def test_the_setting_reaches_processes_started_afterwards(monkeypatch, setting_off):
    _unset(monkeypatch)
    monkeypatch.setattr(policy, "STATIC_LAUNCH_COMPILED_KERNELS", True)
    assert _child_setting() == "False"
    triton_ops._static_launch_compiled_kernels()
    assert inductor_config.static_launch_user_defined_triton_kernels is True
    assert os.environ[ENV] == "1"
    assert _child_setting() == "True"


@pytest.mark.parametrize("users", ["0", "1"])
def test_a_users_environment_setting_is_left_alone(monkeypatch, setting_off, users):
    monkeypatch.setenv(ENV, users)
    triton_ops._static_launch_compiled_kernels()
    assert os.environ[ENV] == users
    assert inductor_config.static_launch_user_defined_triton_kernels is False


def test_policy_off_changes_nothing(monkeypatch, setting_off):
    _unset(monkeypatch)
    monkeypatch.setattr(policy, "STATIC_LAUNCH_COMPILED_KERNELS", False)
    triton_ops._static_launch_compiled_kernels()
    assert ENV not in os.environ
    assert inductor_config.static_launch_user_defined_triton_kernels is False


class _FakeAsyncCompile:
    """Stands in for ``torch._inductor.async_compile``: a set of running pools and the shutdown that empties it."""

    def __init__(self, running: bool):
        self._pool_set = {"pool"} if running else set()
        self.shutdowns = 0

    def shutdown_compile_workers(self):
        self.shutdowns += 1
        self._pool_set.clear()


@pytest.mark.parametrize("running", [True, False], ids=["pool-running", "no-pool"])
def test_a_running_worker_pool_is_restarted_with_the_setting(monkeypatch, setting_off, running):
    # a pool started before the setting keeps Triton's launcher for every kernel it compiles: it is shut down,
    # and Inductor starts the next one with the environment set
    _unset(monkeypatch)
    monkeypatch.setattr(policy, "STATIC_LAUNCH_COMPILED_KERNELS", True)
    fake = _FakeAsyncCompile(running)
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", fake)
    triton_ops._static_launch_compiled_kernels()
    assert os.environ[ENV] == "1"
    assert fake.shutdowns == (1 if running else 0)


def test_a_users_setting_keeps_the_running_pool(monkeypatch, setting_off):
    monkeypatch.setenv(ENV, "0")
    fake = _FakeAsyncCompile(True)
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", fake)
    triton_ops._static_launch_compiled_kernels()
    assert fake.shutdowns == 0
