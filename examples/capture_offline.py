"""Capture offline: collect the residual stream of a few prompts for a probe, to memory and to disk.

    python examples/capture_offline.py [--root /tmp/acts]

The rows of the last prompt token at every layer's post_block come back on ``output.residuals`` (the
``inline`` consumer) and are also written as safetensors files (the ``filesystem`` consumer), read back
with ``read_capture``. A difference-of-means direction between two prompt sets is the simplest probe.
"""

import argparse

import torch
from vllm import SamplingParams

from vllm_interp import LLM
from vllm_interp.capture.consumers.filesystem import read_capture

POSITIVE = ["I loved every minute of it.", "What a wonderful day this is."]
NEGATIVE = ["I hated every minute of it.", "What a miserable day this is."]


def main(llm: LLM, root: str) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    spec = {"hooks": {"post_block": "all"}, "positions": "last_prompt"}
    stacks = {}
    for label, prompts in (("positive", POSITIVE), ("negative", NEGATIVE)):
        captures = [{"inline": spec, "filesystem": {**spec, "tag": f"example/{label}-{i}", "layout": "packed"}}
                    for i in range(len(prompts))]
        outputs = llm.generate(prompts, params, capture=captures, use_tqdm=False)
        assert all(r.status == "ok" for o in outputs for r in o.capture.values())
        # [prompts, layers, hidden]
        stacks[label] = torch.stack([o.residuals.stack("post_block")[:, 0] for o in outputs])
        # The same rows, from disk.
        tensors, _ = read_capture(root, f"example/{label}-0")
        assert torch.equal(tensors["20.post_block"][0], outputs[0].residuals["20.post_block"][0])
    direction = stacks["positive"].mean(0) - stacks["negative"].mean(0)  # [layers, hidden]
    norms = direction.norm(dim=-1)
    return {"strongest_layer": int(norms.argmax()), "max_norm": float(norms.max()), "layers": int(norms.shape[0])}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/tmp/vllm-interp-example-captures")
    args = parser.parse_args()
    llm = LLM(dtype="float32", capture_consumers=("inline", f"filesystem:root={args.root},on_collision=overwrite"))
    print(main(llm, args.root))
    llm.shutdown()
