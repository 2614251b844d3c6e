"""A consumer's row reduction on the GPU: ``logging``'s statistics, reduced on the device as steps run (in
replayed CUDA graphs and eager steps alike) and copied off through pinned memory, equal the statistics of the
rows ``inline`` returns for the same requests."""

import pytest
import torch
from vllm import SamplingParams

from tests.gpu.engine_run import GREEDY, LAYERS, build_llama, prompts
from vllm_interp import LLM
from vllm_interp.capture.consumers.logging import STATS, row_statistics

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = build_llama(tmp_path_factory.mktemp("reductions") / "llama")
    # The engine core in this process, as the one-GPU modes of engine_run.py run it: CUDA may be initialized here.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        engine = LLM(str(model), dtype="float32", attention_backend="TRITON_ATTN", skip_tokenizer_init=True,
                     max_model_len=512, max_num_batched_tokens=16, max_num_seqs=8, gpu_memory_utilization=0.3,
                     seed=0, capture_consumers=("inline", "logging"), enforce_eager=False, max_graph_capture_rows=8)
    yield engine
    engine.shutdown()  # its GPU memory back before the modules after this one


def test_statistics_reduced_on_the_device_equal_those_of_the_rows(llm):
    spec = {"hooks": {"post_block": "all"}, "positions": "all"}
    inputs = [{"prompt_token_ids": p} for p in prompts(3)]
    outputs = llm.generate(inputs, SamplingParams(**GREEDY), capture={"inline": spec, "logging": spec},
                           use_tqdm=False)
    for out in outputs:
        assert {name: r.status for name, r in out.capture.items()} == {"inline": "ok", "logging": "ok"}
        stats = out.capture["logging"].result["stats"]
        assert sorted(stats) == sorted(out.residuals.tensors) and len(stats) == LAYERS
        for site, rows in out.residuals.tensors.items():
            expected = row_statistics(rows)
            got = torch.tensor([stats[site][key] for key in STATS]).T
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    steps = llm.collective_rpc("interp_capture_steps")[0]
    assert steps["graph"] > 0 and steps["eager"] > 0, steps  # decode steps replayed graphs; prefill ran eagerly


def test_a_request_stopped_by_a_stop_token_keeps_no_row_past_its_end(llm):
    """Async scheduling (vLLM's default on GPUs) schedules a request's next step before its stop token is seen,
    so a step runs past the end; its rows are dropped (the scheduler's final length, ``FinalLengths``, or the
    results' own), and a stopped request's rows are those of the tokens it fed the model."""
    unstopped = SamplingParams(**{**GREEDY, "max_tokens": 8})
    for prompt in prompts(5):
        (free,) = llm.generate([{"prompt_token_ids": prompt}], unstopped, use_tqdm=False)
        tokens = list(free.outputs[0].token_ids)
        stop_at = next((i for i in range(2, len(tokens) - 1) if tokens[i] not in tokens[:i]), None)
        if stop_at is not None:
            break
    assert stop_at is not None, "no prompt generated a token fit to stop at"
    stopped = SamplingParams(**{**GREEDY, "max_tokens": 8}, stop_token_ids=[tokens[stop_at]])
    (out,) = llm.generate([{"prompt_token_ids": prompt}], stopped, use_tqdm=False,
                          readout={"hooks": {"post_block": "all"}, "positions": "all"})
    generated = len(out.outputs[0].token_ids)
    assert generated < len(tokens)  # it stopped early, at the stop token
    assert out.residuals.positions == list(range(len(prompt) + generated - 1))
