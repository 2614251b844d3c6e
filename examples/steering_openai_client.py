"""Steering over HTTP with the openai client.

    vllm-interp serve --enable-steering --dtype float32 &
    python examples/steering_openai_client.py --base-url http://localhost:8000 [--api-key KEY]

Per-request vectors ride in ``extra_body``; global steering and named vectors use /v1/steering/*.
"""

import argparse

import numpy as np
import requests
from openai import OpenAI

from vllm_interp import pack_vectors

PROMPT = "My favourite season is"


def main(base_url: str, api_key: str | None = None) -> dict[str, str]:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    layers = requests.get(f"{base_url}/v1/steering/layers").json()
    hidden = layers["hidden_size"]
    vector = np.random.default_rng(0).standard_normal(hidden).astype(np.float32)
    vector *= 8.0 / np.linalg.norm(vector)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def complete(**extra_body) -> str:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                        extra_body=extra_body or None)
        return out.choices[0].text

    texts = {
        "unsteered": complete(),
        # JSON floats, with a scale ...
        "inline": complete(steering_vectors={"post_block": {"10": {"vector": vector.tolist(), "scale": 1.0}}}),
        # ... or the compact base64 form (much smaller to send and parse).
        "inline packed": complete(steering_vectors={"post_block": pack_vectors({10: vector})}),
        "decode tier only": complete(decode_steering_vectors={"post_block": pack_vectors({10: vector})}),
    }
    requests.post(f"{base_url}/v1/steering/vectors/register", headers=headers, timeout=30,
                  json={"name": "example", "vectors": {"post_block": {"10": vector.tolist()}}}).raise_for_status()
    texts["named"] = complete(steering_name="example")
    requests.post(f"{base_url}/v1/steering/vectors/unregister", headers=headers, timeout=30,
                  json={"name": "example"}).raise_for_status()

    requests.post(f"{base_url}/v1/steering/set", headers=headers, timeout=30,
                  json={"vectors": {"post_block": {"10": vector.tolist()}}}).raise_for_status()
    texts["global"] = complete()
    requests.post(f"{base_url}/v1/steering/clear", headers=headers, timeout=30).raise_for_status()
    texts["after clear"] = complete()
    for label, text in texts.items():
        print(f"{label:<18} {PROMPT}{text!r}")
    return texts


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://localhost:8000")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    main(args.base_url, args.api_key)
