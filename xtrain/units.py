"""Units shared by the planner and the TPU preflight."""

GIB = 1024**3  # bytes in a GiB: memory is reported in binary units, as the TPU compiler does
