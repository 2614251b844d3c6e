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


def test_offline_capture_example(smollm2_llm, capture_root):
    probe = _load("capture_offline").main(smollm2_llm, str(capture_root))
    assert probe["layers"] == 30 and probe["max_norm"] > 0


def test_openai_client_capture_example(server):
    url, _ = server
    out = _load("capture_openai_client").main(url)
    assert out["text"].startswith(" Paris")
    assert out["sites"] == ["10.post_block", "20.post_block"] and out["shape"][1] == 576


def test_patch_study_example_writes_a_heatmap(server, tmp_path):
    url, _ = server
    out = _load("patch_study").main(url, str(tmp_path / "eiffel.png"), API_KEY)
    assert (tmp_path / "eiffel.png").stat().st_size > 10_000
    grid = out["grid"]
    assert grid.shape == (30, 10) and out["tokens"][1] == "ĠCol"
    # The clean answer comes back fully when the subject is restored early, and not from unrelated tokens.
    assert grid[0, 1:4].max() > 0.5 and abs(grid[0, 0]) < 0.05


def test_sae_features_example(smollm2_llm):
    from tests.conftest import SAE_LAYER, SAE_NAME

    out = _load("sae_features").main(smollm2_llm, SAE_NAME)
    assert out["site"] == f"{SAE_LAYER}.post_block" and all(len(ids) == 3 for ids in out["top"])
    assert out["texts"]["unsteered"] != list(out["texts"].values())[1]
