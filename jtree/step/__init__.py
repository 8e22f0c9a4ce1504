"""The compiled train step: gradient function with micro-batch accumulation, optimizer, train state, host-side batch assembly and the old-log-prob policy."""
