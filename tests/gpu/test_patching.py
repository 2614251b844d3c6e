"""Patching on GPUs: every (hook, layer, position) cell of a grid patched from a clean run grades the same
under CUDA graphs (patched steps keep their graphs: the op's full-width write is what they replay), tensor
parallel 2, pipeline parallel 2 and on vLLM's V1 runner as on one eager GPU (V2), and one eager GPU grades as
transformers does."""

import numpy as np
import pytest
import torch

from tests.gpu.engine_run import PATCH_GRADED
from tests.gpu.modes import print_figure, with_eager
from tests.reference import HookedReference
from tests.zoo import _input_of
from vllm_interp.hooks import site_name

pytestmark = pytest.mark.gpu

# As for steering (test_steering.py): the same fp32 model up to kernel fusion and reduction order.
SAME_MODEL_TOL = 1e-3
# Against transformers in true fp32 on the CPU: the GPU's fp32 attention runs in TF32 (test_parity.py).
VS_TRANSFORMERS_TOL = 5e-3


@pytest.mark.parametrize("mode", ["graphs", "tp2", "pp2", "v1_eager", "v1_graphs"])
def test_patched_cells_grade_as_on_one_eager_gpu(engines, mode):
    results = with_eager(engines, mode)
    got, want = results[mode]["patching"], results["eager"]["patching"]
    assert got["statuses"] == ["ok"] * len(got["cells"]), got["statuses"]
    diff = float(np.max(np.abs(np.subtract(got["logprobs"], want["logprobs"]))))
    print_figure(f"patching {mode} vs eager", f"{len(got['cells'])} cells, max answer/foil logprob diff {diff:.2e}")
    assert diff <= SAME_MODEL_TOL


def test_eager_cells_grade_as_transformers_does(engines):
    saved = engines("eager", "graphs")["eager"]["patching"]
    assert saved["statuses"] == ["ok"] * len(saved["cells"])
    reference = HookedReference(engines.model, _input_of("post_attention_layernorm"))
    clean = reference.run(saved["clean"]).sites
    worst = 0.0
    for (hook, layer, position), logprobs in zip(saved["cells"], saved["logprobs"], strict=True):
        name = site_name(layer, hook)

        def edit(stream, name=name, position=position):
            stream = stream.clone()
            stream[position] = clean[name][position]
            return stream

        want = torch.log_softmax(reference.run(saved["corrupt"], {name: edit}).logits[-1], dim=-1)[list(PATCH_GRADED)]
        worst = max(worst, float(np.max(np.abs(np.asarray(logprobs) - want.numpy()))))
    print_figure("patching eager vs transformers", f"{len(saved['cells'])} cells, max logprob diff {worst:.2e}")
    assert worst <= VS_TRANSFORMERS_TOL
