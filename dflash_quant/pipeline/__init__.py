"""The `gptq` job: a typed job checked once (job.py), run under one output guard (run.py), through plain stage
functions (stages.py: load -> inputs -> calibrate -> (mix) -> quantize -> record -> export -> verify -> report ->
card; calibrate.py, mixed_stage.py and parity.py hold the larger ones, batching.py the rows per batch)."""
