import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests import their shared tiny components

import pytest  # noqa: E402
import torch  # noqa: E402

# What the tests and the processes they start put in the temporary folder goes to a folder of this run, removed
# when the run passes: gradio_client leaves an empty folder in /tmp for every file it downloads, each server test
# leaves its log, each Ray cluster its session folder. Set before any test module imports gradio, which takes its
# cache folder from it at import. (A short path: Ray's Unix sockets live under it.) Under pytest-xdist the workers
# inherit TMPDIR from the controller, whose folder it is: they share it, and the controller removes it.
if "PYTEST_XDIST_WORKER" in os.environ:
    RUN_TEMP = Path(os.environ["TMPDIR"])
else:
    RUN_TEMP = Path(tempfile.mkdtemp(prefix="rolldiff-tests-"))
tempfile.tempdir = os.environ["TMPDIR"] = str(RUN_TEMP)

# Tiny tensors: one thread is faster than several and keeps the suite steady on a busy 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Scripts run in-process (benchmarks, training) set their own thread count; put it back after each test,
    so results that must match bit for bit (threads vs alone) never depend on test order."""
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _diffusers_default_attention():
    """diffusers' own `ModelMixin.set_attention_backend` (tests call it directly) also sets its process-wide
    backend, which `reset_attention_backend` leaves; put it back after each test so none runs another's kernel."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before, _ = _AttentionBackendRegistry.get_active_backend()
    yield
    _AttentionBackendRegistry.set_active_backend(before)


@pytest.fixture(autouse=True)
def _no_server_outlives_its_test():
    """A `rolldiff serve` subprocess that a test started and did not stop (an assert failed first) is stopped after
    it, so it neither loads the machine for the tests after it nor outlives the run. Servers of module fixtures were
    started before the test and are left to their fixture."""
    helpers = sys.modules.get("serve_helpers")
    before = len(helpers.Server.started) if helpers else 0
    yield
    helpers = sys.modules.get("serve_helpers")
    if helpers is None:
        return
    for server in helpers.Server.started[before:]:
        server.stop(seconds=20.0)
    del helpers.Server.started[before:]


@pytest.fixture
def model_calls(pipe) -> list:
    """One entry per call of the module's `pipe` transformer: proof that no work was done."""
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda *args: calls.append(1))
    yield calls
    handle.remove()


@pytest.fixture(scope="module")
def one_ray_cluster_at_a_time():
    """Held by a module of Ray tests while it runs: under pytest-xdist the other process's Ray modules wait, since two
    Ray clusters on one machine find each other (`--ray-address auto` looks for any GCS process here)."""
    import fcntl

    with open(RUN_TEMP / "ray-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_terminal_summary(terminalreporter, exitstatus: int) -> None:
    """A failed or interrupted run keeps its temporary folder (the servers' logs) and says where; any other removes it.
    Under pytest-xdist only the controller does: a worker that finishes first would remove it under the other."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    if exitstatus in (pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.INTERRUPTED):
        terminalreporter.write_line(f"temporary files of this run (the servers' logs): {RUN_TEMP}")
    else:
        shutil.rmtree(RUN_TEMP, ignore_errors=True)
