"""`vllm-interp demo`: generate with the default model and read its residual stream."""

from vllm import SamplingParams

from vllm_interp.llm import LLM


def run_demo(model: str | None, prompt: str, max_tokens: int) -> None:
    llm = LLM(model, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=256 << 20, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    (output,) = llm.generate([prompt], params, readout={"positions": "all"}, use_tqdm=False)
    readout = output.residuals
    completion = output.outputs[0].text
    print(f"\nprompt:     {prompt!r}\ncompletion: {completion!r}\n")
    last = len(output.prompt_token_ids) - 1
    print(f"residual read-out: {len(readout.sites)} sites x {len(readout.positions)} positions "
          f"(prompt {last + 1} tokens + {len(readout.positions) - last - 1} generated)")
    print(f"L2 norm of the stream at the last prompt token (position {last}):")
    print(f"{'layer':>5} {'pre_attn':>10} {'post_attn':>10} {'post_block':>11}")
    pre, mid, post = (readout.stack(hook)[:, last].norm(dim=-1) for hook in ("pre_attn", "post_attn", "post_block"))
    for layer in range(pre.shape[0]):
        print(f"{layer:>5} {pre[layer]:>10.2f} {mid[layer]:>10.2f} {post[layer]:>11.2f}")
    # post_block(L) and pre_attn(L + 1) are the same stream, read at two different sites.
    chain = (readout.stack("post_block")[:-1] - readout.stack("pre_attn")[1:]).abs().max().item()
    print(f"max |post_block(L) - pre_attn(L+1)| over all positions: {chain:.1e}")
    llm.shutdown()
