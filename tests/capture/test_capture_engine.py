"""Capture on the real SmolLM2 engine: exact rows for every position kind, through the prefix cache, to the
built-in consumers."""

import time

import pytest
import torch
from vllm import SamplingParams

from tests.parity import assert_rows_close, compare
from tests.reference import hf_residuals
from tests.zoo import _input_of
from vllm_interp.capture.consumers.filesystem import list_captures, read_capture

MAX_TOKENS = 5
NUM_LAYERS = 30


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _sequence(output) -> list[int]:
    # The last generated token is sampled but never fed back: it has no residual.
    return list(output.prompt_token_ids) + list(output.outputs[0].token_ids)[:-1]


def _expected(positions, prompt_len: int, length: int) -> list[int]:
    match positions:
        case "all_prompt":
            return list(range(prompt_len))
        case "last_prompt":
            return [prompt_len - 1]
        case "all_generated":
            return list(range(prompt_len, length))
        case explicit:
            return sorted(explicit)


def test_every_position_kind_equals_transformers_in_one_continuous_batch(
    smollm2_llm, smollm2_path, prompt_ids, parity_table
):
    kinds = ["all_prompt", "last_prompt", "all_generated", [0, 5, len(prompt_ids[3]) + 1]]
    captures = [{"inline": {"positions": kind}} for kind in kinds]
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    outputs = smollm2_llm.generate(prompts, _greedy(), capture=captures, use_tqdm=False)
    sequences = [_sequence(o) for o in outputs]
    readouts = []
    for output, kind, sequence in zip(outputs, kinds, sequences, strict=True):
        result = output.capture["inline"]
        assert result.status == "ok", result.message
        expected = _expected(kind, len(output.prompt_token_ids), len(sequence))
        assert output.residuals.positions == expected
        assert result.rows == len(expected) * NUM_LAYERS * 3
        readouts.append(output.residuals)
    references = hf_residuals(smollm2_path, sequences, _input_of("post_attention_layernorm"))
    parity_table.append(("smollm2 capture kinds", compare(readouts, references, num_layers=NUM_LAYERS)))


def test_prompt_rows_served_from_the_prefix_cache_are_still_captured_exactly(
    smollm2_llm, smollm2_path, smollm2_tokenizer, parity_table
):
    # Three full 128-token blocks: long enough for the CPU engine's prefix cache.
    text = " ".join(f"Row {i} of the ledger records a {['small', 'large', 'odd'][i % 3]} parcel." for i in range(40))
    prompt = [{"prompt_token_ids": smollm2_tokenizer(text).input_ids[:400]}]
    smollm2_llm.generate(prompt, _greedy(2), use_tqdm=False)  # caches the prompt's blocks

    sites = {"pre_attn": [0, 14], "post_attn": [7, 29], "post_block": [3, 29]}
    (every,) = smollm2_llm.generate(prompt, _greedy(2), use_tqdm=False,
                                    capture={"inline": {"hooks": sites, "positions": "all_prompt"}})
    # Rows before the last prompt token could come from the cache: such a capture bypasses it.
    assert every.num_cached_tokens == 0
    (last,) = smollm2_llm.generate(prompt, _greedy(2), use_tqdm=False,
                                   capture={"inline": {"hooks": "all", "positions": "last_prompt"}})
    # The last prompt token is always computed, so this capture keeps the cache.
    assert last.num_cached_tokens >= 384
    assert every.capture["inline"].status == last.capture["inline"].status == "ok"
    assert every.residuals.positions == list(range(400)) and last.residuals.positions == [399]

    (reference,) = hf_residuals(smollm2_path, [_sequence(every)], _input_of("post_attention_layernorm"))
    for readout in (every.residuals, last.residuals):
        for name, got in readout.tensors.items():
            assert_rows_close(got, reference[name][readout.positions], name)


def test_filesystem_layouts_hold_the_rows_the_caller_got(smollm2_llm, capture_root, prompt_ids):
    hooks = {"post_block": [3, 7], "pre_attn": [0]}
    for layout in ("packed", "per_file"):
        tag = f"engine/{layout}"
        capture = {
            "inline": {"hooks": hooks, "positions": "all_prompt"},
            "filesystem": {"hooks": hooks, "positions": "all_prompt", "tag": tag, "layout": layout},
        }
        (out,) = smollm2_llm.generate([{"prompt_token_ids": prompt_ids[1]}], _greedy(), capture=capture,
                                      use_tqdm=False)
        written = out.capture["filesystem"]
        assert written.status == "ok", written.message
        assert written.result["layout"] == layout
        tensors, meta = read_capture(capture_root, tag)
        assert meta["positions"] == out.residuals.positions and meta["tag"] == tag
        assert meta["sites"] == ["0.pre_attn", "3.post_block", "7.post_block"]
        for name, tensor in tensors.items():
            torch.testing.assert_close(tensor, out.residuals[name], rtol=0, atol=0)


def test_a_sharded_capture_is_taken_in_parts_while_the_request_runs(smollm2_llm, capture_root, prompt_ids):
    """Every site at every position (about 200 KB a position) to the sharded layout, whose parts are 1 MiB: the
    request's rows reach the consumer in several parts while it runs, and read back as the rows the same
    request returns inline. Its final part waits in the shard buffer until a later request's part fills the
    shard (1 MiB). A request that also names ``inline`` (which takes requests whole) is written whole."""
    every = {"hooks": "all", "positions": "all"}
    sharded = {**every, "layout": "sharded"}
    prompt = [{"prompt_token_ids": prompt_ids[2]}]
    (out,) = smollm2_llm.generate(prompt, _greedy(16), capture={"filesystem": {**sharded, "tag": "engine/parts"}},
                                  use_tqdm=False)
    written = out.capture["filesystem"]
    assert written.status == "ok", written.message
    (inline,) = smollm2_llm.generate(prompt, _greedy(16), capture={"inline": every, "filesystem": {
        **sharded, "tag": "engine/whole"}}, use_tqdm=False)
    positions = inline.residuals.positions
    assert written.result["parts"] > 2 and written.rows == len(positions) * NUM_LAYERS * 3
    assert "parts" not in inline.capture["filesystem"].result
    deadline = time.monotonic() + 60  # the whole request's part filled the shard: the writer publishes it
    while "engine/parts" not in list_captures(capture_root) and time.monotonic() < deadline:
        time.sleep(0.2)
    tensors, meta = read_capture(capture_root, "engine/parts")
    assert meta["positions"] == positions and meta["parts"] == written.result["parts"]
    assert sorted(tensors) == sorted(inline.residuals.tensors)
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, inline.residuals[name], rtol=0, atol=0)


def test_a_collision_fails_only_that_request_and_says_why(smollm2_llm, prompt_ids):
    capture = {"filesystem": {"hooks": {"post_block": [1]}, "tag": "engine/once"}}
    prompts = [{"prompt_token_ids": prompt_ids[0]}]
    (first,) = smollm2_llm.generate(prompts, _greedy(), capture=capture, use_tqdm=False)
    (second,) = smollm2_llm.generate(prompts, _greedy(), capture=capture, use_tqdm=False)
    assert first.capture["filesystem"].status == "ok"
    assert second.capture["filesystem"].status == "error"
    assert "FileExistsError" in second.capture["filesystem"].message
    # The engine goes on serving.
    (third,) = smollm2_llm.generate(prompts, _greedy(), capture={**capture, "inline": {}}, use_tqdm=False)
    assert third.capture["inline"].status == "ok"


def test_logging_consumer_reports_row_statistics(smollm2_llm, prompt_ids):
    capture = {name: {"hooks": {"post_attn": [12]}, "positions": "all_prompt"} for name in ("logging", "inline")}
    (out,) = smollm2_llm.generate([{"prompt_token_ids": prompt_ids[2]}], _greedy(), capture=capture,
                                  use_tqdm=False)
    stats = out.capture["logging"].result["stats"]["12.post_attn"]
    norms = out.residuals["12.post_attn"].norm(dim=-1)
    torch.testing.assert_close(torch.tensor(stats["norm"]), norms, rtol=1e-5, atol=1e-4)
    # The packed format carries the same numbers as one [sites, positions, statistics] tensor.
    capture["logging"]["format"] = "packed"
    (packed,) = smollm2_llm.generate([{"prompt_token_ids": prompt_ids[2]}], _greedy(), capture=capture,
                                     use_tqdm=False)
    result = packed.capture["logging"].result
    assert result["sites"] == ["12.post_attn"] and result["statistics"][0] == "norm"
    torch.testing.assert_close(result["stats"][0, :, 0], torch.tensor(stats["norm"]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("positions", ["all", "all_generated"])
def test_generated_rows_are_neither_lost_nor_duplicated_across_steps(smollm2_llm, prompt_ids, positions):
    params = _greedy(12)
    (out,) = smollm2_llm.generate([{"prompt_token_ids": prompt_ids[3]}], params, use_tqdm=False,
                                  capture={"inline": {"hooks": {"post_block": [29]}, "positions": positions}})
    prompt_len = len(out.prompt_token_ids)
    start = 0 if positions == "all" else prompt_len
    assert out.residuals.positions == list(range(start, prompt_len + 11))


def test_offline_capture_beyond_the_byte_bound_is_refused(smollm2_llm, prompt_ids):
    """The offline front door applies --max-capture-bytes-per-request's check, as the server does."""
    from vllm_interp.capture.spec import CaptureSpecError
    from vllm_interp.config import FrontendLimits

    kept = smollm2_llm.frontend.limits
    smollm2_llm.frontend.limits = FrontendLimits(max_capture_bytes_per_request=1 << 20)
    try:
        every_site = {"hooks": "all", "positions": "all"}  # 90 sites x 576 x 4 bytes = 207 KB per position
        for prompt in ({"prompt_token_ids": prompt_ids[0]}, "The capital of France is"):
            with pytest.raises(CaptureSpecError, match=r"capture.inline: up to \d+ bytes .* prompt length 5"):
                smollm2_llm.generate(prompt, SamplingParams(max_tokens=8), readout=every_site)
        one_site = {"hooks": {"post_block": [3]}, "positions": "all"}
        assert smollm2_llm.generate("The capital of France is", SamplingParams(max_tokens=8),
                                    readout=one_site)[0].residuals is not None
    finally:
        smollm2_llm.frontend.limits = kept


def test_the_worker_learns_a_finished_requests_final_length_from_the_scheduler(smollm2_llm):
    """A request that finishes while another runs is reported finished on the next step's SchedulerOutput,
    before anyone asks for its results: its final length reaches the worker beside its id (``FinalLengths``),
    through the CPU engine's executor. The CPU's scheduler is synchronous, so no step runs past a stop and no
    position is dropped."""
    before = smollm2_llm.collective_rpc("interp_capture_steps")[0]
    early, late = smollm2_llm.generate(["The capital of France is", "The capital of Spain is"],
                                       [_greedy(1), _greedy(MAX_TOKENS)], use_tqdm=False,
                                       readout={"hooks": {"post_block": [29]}, "positions": "all"})
    after = smollm2_llm.collective_rpc("interp_capture_steps")[0]
    for out in (early, late):
        assert len(out.residuals.positions) == len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    assert after["finished_with_length"] - before["finished_with_length"] >= 1  # the early one at least
    assert after["positions_past_end"] == before["positions_past_end"]


def test_the_worker_counts_every_step_and_on_the_cpu_none_replays_a_graph(smollm2_llm):
    """The serving benchmarks' step counts (``interp_capture_steps``): a capturing request's every step is
    counted, each read eagerly, and a CPU forward never replays a CUDA graph; the engine process's garbage
    collections are counted too, and where its results' wait went. Its prompt is its own, so no prefix-cache
    hit shortens its prefill."""
    chunk = 16  # the shared engine's max_num_batched_tokens
    prompt = [(7919 * i) % 40000 + 100 for i in range(2 * chunk + 5)]  # three prefill chunks
    before = smollm2_llm.collective_rpc("interp_capture_steps")[0]
    (out,) = smollm2_llm.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False,
                                  capture={"inline": {"hooks": {"post_block": [29]}, "positions": "all"}})
    after = smollm2_llm.collective_rpc("interp_capture_steps")[0]
    ran = {key: after[key] - before[key] for key in ("steps", "replayed", "eager", "graph")}
    assert len(out.residuals.positions) == len(prompt) + MAX_TOKENS - 1
    assert ran == {"steps": 3 + MAX_TOKENS - 1, "replayed": 0, "eager": 3 + MAX_TOKENS - 1, "graph": 0}
    # The engine process's garbage collections, counted and timed from start-up (``engine/gc_clock.py``).
    assert all(after[f"gc{g}"] >= before[f"gc{g}"] and after[f"gc{g}_ms"] >= 0 for g in range(3))
    assert after["gc2"] > 0  # vLLM collects fully before it freezes its start-up heap
    # Its results' timeline: one request answered, its end -> rows handed on -> consumer done -> answer.
    assert after["results_answered"] - before["results_answered"] == 1
    stages = [after[f"results_{stage}_ms"] - before[f"results_{stage}_ms"] for stage in ("land", "consume", "claim")]
    assert all(ms >= 0 for ms in stages) and 0 < sum(stages) < 60_000
