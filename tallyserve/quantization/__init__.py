"""FP8 projections: the numerics (``fp8``), how a model's projections take FP8 weights and their scales from a
checkpoint or at load (``loading``), and the product dispatch (``fp8.fp8_linear``)."""
