"""Tests for ``amp_plugin.kernels``: choosing a backend, and what importing the package loads."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from amp_plugin.kernels import get_kernels
from amp_plugin.kernels._apex import ApexKernels
from tests.fakes import fake_apex, no_apex

# --- choosing a backend ---------------------------------------------------------------------------


def test_auto_on_cpu_is_torch() -> None:
    assert get_kernels("auto", "cpu").name == "torch"
    assert get_kernels("auto").name == "torch"


def test_auto_on_cuda_is_apex_when_amp_c_imports() -> None:
    with fake_apex():
        assert get_kernels("auto", "cuda").name == "apex"
    with no_apex():
        assert get_kernels("auto", "cuda").name == "torch"


def test_explicit_apex_without_amp_c_raises_with_a_build_hint() -> None:
    with no_apex():
        with pytest.raises(RuntimeError, match=r"amp_C.*HINT:.*--cuda_ext"):
            get_kernels("apex", "cuda")
        with pytest.raises(ImportError, match=r"amp_C.*HINT:.*--cuda_ext"):
            ApexKernels()


def test_explicit_apex_off_cuda_raises() -> None:
    with fake_apex(), pytest.raises(RuntimeError, match=r"CUDA tensors only.*'cpu'.*HINT:"):
        get_kernels("apex", "cpu")


def test_unknown_backend_raises() -> None:
    with pytest.raises(
        ValueError,
        match=r"^get_kernels\(backend='triton'\) is not allowed here: "
            r".*one of 'auto', 'torch', 'apex'\. HINT:",
    ):
        get_kernels("triton")  # type: ignore[arg-type]


def test_unknown_device_raises_with_what_is_allowed_and_a_hint() -> None:
    with pytest.raises(ValueError, match=r"get_kernels\(device='gpu'\) is not allowed.*HINT: .*'cuda'"):
        get_kernels(device="gpu")
    with pytest.raises(ValueError, match=r"get_kernels\(device='CPU'\) is not allowed here: "
        r".*.*HINT: .*'cpu'"):
        get_kernels("torch", "CPU")
    with pytest.raises(TypeError, match=r"get_kernels\(device=\[0\]\) is not allowed here: .*.*HINT:"):
        get_kernels(device=[0])  # type: ignore[arg-type]


@pytest.mark.slow  # a subprocess or processes: the one-thread pass leaves it out
def test_import_loads_neither_apex_nor_lightning_nor_cuda() -> None:
    code = textwrap.dedent(
        """
        import sys
        import torch
        import amp_plugin
        from amp_plugin.kernels import get_kernels

        get_kernels("auto", "cpu")
        banned = ("amp_C", "apex", "lightning", "pytorch_lightning", "lightning_fabric")
        print(sorted(m for m in sys.modules if m.split(".")[0] in banned), torch.cuda.is_initialized())
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert (result.returncode, result.stdout.split()) == (0, ["[]", "False"]), result.stderr
