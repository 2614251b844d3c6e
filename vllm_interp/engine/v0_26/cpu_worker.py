"""vLLM's CPU worker with the hook sites.

A module of its own because importing vLLM's CPU worker replaces ``torch.cuda.Event`` process-wide
(``vllm/v1/worker/cpu/shm.py``), which breaks Inductor's autotuning in a GPU worker.
"""

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_interp.engine.v0_26.worker import InterpWorkerMixin


class InterpCPUWorker(InterpWorkerMixin, CPUWorker):
    pass
