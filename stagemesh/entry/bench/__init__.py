"""`stagemesh bench`: a serving benchmark client (workload, load, backends, report, transformers baseline)."""
