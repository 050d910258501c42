from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache(tmp_path_factory):
    """Keep the tests' compiled kernels out of the user's cache directory, and the user's own
    tuning logs out of the tests' lookups. Backward kernels are not compiled ahead on a thread
    (``tests/test_background.py`` turns that on): a compile still running when its test ends
    would meet the next test's patched compiler and cleared kernel memory."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TVM_DEFORM_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
    mp.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("data-home")))
    mp.delenv("TVM_DEFORM_LOGS", raising=False)
    mp.setenv("TVM_DEFORM_PREPARE_BACKWARD", "0")
    yield
    mp.undo()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "") -> None:
    """Norm-relative error ``|actual - expected| / |expected|`` within ``rtol``; on failure,
    print the first mismatching elements."""
    actual_d, expected_d = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    error = float((actual_d - expected_d).norm() / expected_d.norm().clamp_min(1e-300))
    if error <= rtol:
        return
    diff = (actual_d - expected_d).abs()
    scale = expected_d.abs().max().clamp_min(1e-300)
    worst = torch.nonzero(diff > rtol * scale)[:8]
    lines = [
        f"  at {tuple(i.tolist())}: got {actual_d[tuple(i)].item():.10g}, "
        f"expected {expected_d[tuple(i)].item():.10g}"
        for i in worst
    ]
    raise AssertionError(
        f"{name}: relative error {error:.3e} > {rtol:.1e}; first mismatches:\n" + "\n".join(lines)
    )


@pytest.fixture
def fresh_lookups():
    """Tuning records and compiled kernels looked up afresh before and after the test (the log
    directories change between tests)."""
    from tvm_deform.runtime import dispatch, kernels, records

    records.forget_databases()
    kernels.clear_memory_cache()
    dispatch._failed.clear()
    yield
    records.forget_databases()
    kernels.clear_memory_cache()
    dispatch._failed.clear()
