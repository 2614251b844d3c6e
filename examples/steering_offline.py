"""Steering offline: derive a direction from the model's own residual stream, then steer with it.

    python examples/steering_offline.py

1. Read the residual stream (post_block of one layer, last prompt token) for two contrasting prompt sets.
2. The difference of their means is a steering direction (the usual contrastive recipe).
3. Generate with it per request (prefill or decode tier, scaled), globally, and by name.
"""

import numpy as np
from vllm import SamplingParams

from vllm_interp import LLM, steered_params

LAYER, HOOK = 12, "post_block"
POSITIVE = ["I absolutely love this, it is wonderful", "What a fantastic, joyful day", "This is great news"]
NEGATIVE = ["I absolutely hate this, it is awful", "What a terrible, miserable day", "This is dreadful news"]
PROMPT = "My opinion of the new restaurant is that"


def contrastive_direction(llm: LLM) -> np.ndarray:
    readout = {"hooks": {HOOK: [LAYER]}, "positions": "last_prompt"}
    params = SamplingParams(max_tokens=1)
    pos = [o.residuals[LAYER, HOOK][0] for o in llm.generate(POSITIVE, params, readout=readout, use_tqdm=False)]
    neg = [o.residuals[LAYER, HOOK][0] for o in llm.generate(NEGATIVE, params, readout=readout, use_tqdm=False)]
    direction = (sum(pos) / len(pos) - sum(neg) / len(neg)).numpy()
    return direction / np.linalg.norm(direction)


def main(llm: LLM) -> dict[str, str]:
    direction = contrastive_direction(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    spec = {HOOK: {str(LAYER): {"vector": direction.tolist(), "scale": 8.0}}}
    runs = {
        "unsteered": greedy,
        "+positive (every token)": steered_params(greedy, steering_vectors=spec),
        "+positive (generated tokens only)": steered_params(greedy, decode_steering_vectors=spec),
        "-positive (prompt only)": steered_params(
            greedy, prefill_steering_vectors={HOOK: {str(LAYER): {"vector": direction.tolist(), "scale": -8.0}}}
        ),
    }
    outputs = llm.generate([PROMPT] * len(runs), list(runs.values()), use_tqdm=False)
    texts = {label: out.outputs[0].text for label, out in zip(runs, outputs, strict=True)}

    llm.register_steering_vectors("positive", vectors=spec)
    texts["named 'positive'"] = llm.generate(
        [PROMPT], steered_params(greedy, steering_name="positive"), use_tqdm=False)[0].outputs[0].text
    llm.unregister_steering_vectors("positive")

    llm.set_steering(vectors=spec)  # every request from now on
    texts["global +positive"] = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text
    llm.clear_steering()

    for label, text in texts.items():
        print(f"{label:<36} {PROMPT}{text!r}")
    return texts


if __name__ == "__main__":
    main(LLM(dtype="float32", enable_steering=True))
