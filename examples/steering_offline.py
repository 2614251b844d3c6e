"""Steering offline: derive a direction from the model's own residual stream, then steer with it.

    python examples/steering_offline.py

1. ``llm.contrastive_vector``: the mean residual stream (post_block of one layer, last prompt token) of
   positive prompts minus that of negative ones, in one batch (the usual contrastive recipe).
2. Generate with it per request (prefill or decode tier, scaled), globally, and by name.
"""

from vllm import SamplingParams

from vllm_interp import LLM, steered_params

LAYER, HOOK = 12, "post_block"
POSITIVE = ["I absolutely love this, it is wonderful", "What a fantastic, joyful day", "This is great news"]
NEGATIVE = ["I absolutely hate this, it is awful", "What a terrible, miserable day", "This is dreadful news"]
PROMPT = "My opinion of the new restaurant is that"


def main(llm: LLM) -> dict[str, str]:
    direction = llm.contrastive_vector(POSITIVE, NEGATIVE, hook=HOOK, layers=[LAYER], normalize=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    spec = direction.steering_spec(scale=8.0)
    runs = {
        "unsteered": greedy,
        "+positive (every token)": steered_params(greedy, steering_vectors=spec),
        "+positive (generated tokens only)": steered_params(greedy, decode_steering_vectors=spec),
        "-positive (prompt only)": steered_params(
            greedy, prefill_steering_vectors=direction.steering_spec(scale=-8.0)),
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
