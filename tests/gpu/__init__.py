"""GPU checks (CUDA graphs, tensor and pipeline parallelism), marked ``gpu``; run on the device by ``run-on-device``."""
