"""The examples in examples/ run against the shared engines (their `main` takes the engine or URL)."""

import importlib.util
from pathlib import Path

from tests.conftest import API_KEY

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_offline_steering_example(smollm2_llm):
    texts = _load("steering_offline").main(smollm2_llm)
    assert texts["global +positive"] == texts["+positive (every token)"]
    assert texts["named 'positive'"] == texts["+positive (every token)"]
    assert texts["+positive (every token)"] != texts["unsteered"]
    assert smollm2_llm.get_steering()["vectors"] == {}


def test_openai_client_steering_example(server):
    url, _ = server
    texts = _load("steering_openai_client").main(url, API_KEY)
    assert texts["after clear"] == texts["unsteered"]
    assert texts["inline"] == texts["inline packed"] == texts["named"] == texts["global"]
