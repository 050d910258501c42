"""The tools: the ``tvm-deform`` command (:mod:`.cli`), benchmarks (:mod:`.bench`,
:mod:`.bench_model`, :mod:`.compare`, :mod:`.peers`), tuning (:mod:`.tuning`, :mod:`.fleet`,
:mod:`.merge`), the workload suite (:mod:`.suite`) and offline CUDA builds (:mod:`.cuda_build`).
Scripts for experiments and GPU runs live in the repository's ``lab/``, outside the package."""
