"""How the kernels are scheduled, one module per target family (installed as
``tvm_deform.schedules``)."""
