"""The tools: the ``tvm-deform`` command (:mod:`.cli`), benchmarks (:mod:`.bench`,
:mod:`.bench_model`, :mod:`.compare`, :mod:`.peers`), tuning (:mod:`.tuning`), the workload
suite (:mod:`.suite`), shared random inputs (:mod:`.inputs`), offline CUDA builds
(:mod:`.cuda_build`) and the GPU session (:mod:`.gpu_session`)."""
