"""Build and dispatch: targets and hardware keys (:mod:`.targets`, :mod:`.hardware`), the tuning
records (:mod:`.records`) and the measured choice among them (:mod:`.dispatch`), compilation and
the kernel caches (:mod:`.kernels`), and the launcher that runs CPU kernels on torch's threads
(:mod:`.launcher`)."""
