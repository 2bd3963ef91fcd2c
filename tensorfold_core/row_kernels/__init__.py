"""Row-invariant kernels every family may serve: the GEMV, RMSNorm and window attention, each family proving its own
records of them at its own shapes (`record`), and the modules that serve those records in a forward (`modules`)."""
