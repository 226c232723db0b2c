"""tallyserve's kernels, named by what they compute: the compiled CPU operators (``csrc/``, loaded by
``cpu_kernels``) and the Triton kernels (paged attention, the KV-cache write, GEMV, fused layer operators, the
grammar mask over logits, programmatic dependent launch). Everything above (attention backends, models, the
runner, structured outputs) calls them; they import nothing of tallyserve but ``envs``."""
