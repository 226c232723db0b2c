"""For tests that call a compiled CPU kernel with a bad input on purpose, to see its own TORCH_CHECK refuse it:
where an error thrown in the kernels does not reach Python (cpu_kernels' load-time probe; issue 36: a segmentation
fault instead), those tests skip. The inputs they use are refused by the Python checks before any kernel call, as
the tests of test_cpu_kernel_errors.py and the ValueError tests beside these show."""

import pytest

from tallyserve.kernels import cpu_kernels

RAW_THROW = pytest.mark.skipif(
    not (cpu_kernels.load() and cpu_kernels.errors_cross()),
    reason="exercises the C++ TORCH_CHECK itself: an error thrown in the CPU kernels does not reach Python on this "
           "host (or they did not build), see cpu_kernels' load-time probe; the Python checks cover the same inputs")
