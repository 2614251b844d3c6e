"""Property-based fuzzing of vllm-interp's HTTP surface against a running `vllm-interp serve`.

Three parts, shared by tests/server/test_fuzz.py (a few hundred cases in CI) and benchmarks/fuzz.py (10,000+):

- hypothesis strategies (``families``) that build ``Case``s for every endpoint: mostly-valid bodies with
  one field of ours broken (``broken``: the 4xx must name that field), valid and edge-case bodies (huge but
  finite values, lax spellings: accepted with their effect, or refused naming the field), random JSON in our
  fields, raw bodies (not JSON, deeply nested, wrong content types) and requests without the API key;
- ``Fuzzer``, which sends a case with a deadline and checks the property on the answer (``check``): never a
  5xx or a hang; a 4xx carries a JSON error whose ``param`` names the offending field; an accepted field of
  ours shows its effect (``capture`` -> ``capture_results``, steering -> output moved, ``/v1/steering/set`` ->
  ``GET /v1/steering``, ...), and a broken one is never accepted;
- ``BackgroundStream``: a thread sending fixed greedy requests (plain, steered, capturing) throughout, whose
  answers must stay equal to its first ones (text, and logprobs within round-off: ``ROUND_OFF``).

The server is the one tests/conftest.py ``server`` starts (every feature on, API key ``API_KEY``), with a
source run ``CLEAN_RUN`` captured before fuzzing (``Fuzzer.prepare``). Global steering set by a case is always
zero vectors, so that it leaves every other request's output unchanged.
"""

import json
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import requests
from hypothesis import strategies as st

from tests.conftest import API_KEY, ENV_API_KEYS, HIDDEN, SAE_FEATURES, SAE_LAYER, SAE_NAME, vector
from tests.steering.common import ROUND_OFF
from vllm_interp import pack_vectors
from vllm_interp.hooks import parse_site_name

NUM_LAYERS = 30
HOOKS = ("pre_attn", "post_attn", "post_block")
TL_HOOKS = {"pre_attn": "hook_resid_pre", "post_attn": "hook_resid_mid", "post_block": "hook_resid_post"}
PROMPT, PROMPT_IDS = "The capital of France is", [504, 3575, 282, 4649, 314]
CORRUPT, CORRUPT_IDS = "The capital of Italy is", [504, 3575, 282, 7158, 314]
PROMPT_TOKENS = 5
CHAT = [{"role": "user", "content": "Say hi"}]
# A stored source run every patch and sweep case may name; no case deletes or re-captures it.
CLEAN_RUN = "fuzz-clean"
RUN_TAGS = ("fuzz-run-0", "fuzz-run-1", "fuzz-run-2")
FILE_TAGS = ("fuzz/a", "fuzz/b/c", "fuzz/d.e-f")
# Named vectors a case may register or unregister; "formal" (loaded at start-up) is never touched.
NAMES = ("fuzz-a", "fuzz-b", "fuzz-c")
PRELOADED_NAME = "formal"
GENERATION_FIELDS = ("steering_vectors", "prefill_steering_vectors", "decode_steering_vectors", "steering_name",
                     "capture", "patch")
STEERING_TIER_FIELDS = GENERATION_FIELDS[:3]
GLOBAL_TIER_FIELDS = ("vectors", "prefill_vectors", "decode_vectors")
COMPLETIONS, CHAT_COMPLETIONS, CHAT_BATCH = "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch"
GENERATION_PATHS = (COMPLETIONS, CHAT_COMPLETIONS, CHAT_BATCH)
# The fields each endpoint knows (a refusal of a random body may name a required one the body lacks).
ENDPOINT_FIELDS = {
    "/v1/steering/set": (*GLOBAL_TIER_FIELDS, "replace"),
    "/v1/steering/vectors/register": ("name", *GLOBAL_TIER_FIELDS),
    "/v1/steering/vectors/unregister": ("name",),
    "/v1/steering/vectors/contrastive": ("positive", "negative", "hook", "layers", "positions", "normalize", "name"),
    "/v1/patch_sweep": ("model", "prompt", "clean_prompt", "source_run", "ablate", "hooks", "hook", "layers",
                        "positions", "alpha", "answer_token", "answer_token_id", "foil_token", "foil_token_id",
                        "metric", "stream"),
    **{path: (*GENERATION_FIELDS, "vllm_xargs") for path in GENERATION_PATHS},
}
# A steering vector of at least this norm moves the output far past round-off.
VISIBLE_NORM = 1.0
GENERATION_TIMEOUT_S = 120.0


# -- cases -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Effect:
    """What an accepted case must show: ``kind`` names the check in ``Fuzzer._effect_problems``."""

    kind: str
    detail: Any = None


@dataclass
class Case:
    """One request. ``mode``: valid | broken | edge | random | raw. ``broken`` is the field a broken or edge
    case puts at stake (a refusal must name it, or one of ``also``); ``tolerate`` maps statuses a case may get
    besides 2xx (state: a name not registered, a run not held) to the field their error must name."""

    endpoint: str
    path: str
    mode: str
    method: str = "POST"
    body: Any = None
    raw: bytes | None = None
    content_type: str | None = "application/json"
    auth: str | None = "bearer"
    needs_key: bool = False
    broken: str | None = None
    also: tuple[str, ...] = ()  # other fields a refusal may name instead, when several are at stake
    tolerate: dict[int, str] = field(default_factory=dict)
    effect: Effect | None = None

    @property
    def keyed(self) -> bool:
        return self.auth in ("bearer", "x-api-key", "env-key")

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": self.content_type} if self.content_type else {}
        return headers | {
            "bearer": {"Authorization": f"Bearer {API_KEY}"}, "x-api-key": {"X-API-Key": API_KEY},
            "env-key": {"X-API-Key": ENV_API_KEYS[1]}, "wrong-key": {"Authorization": f"Bearer {API_KEY}x"},
        }.get(self.auth or "", {})

    def data(self) -> bytes | None:
        if self.raw is not None:
            return self.raw
        return None if self.body is None else json.dumps(self.body).encode()

    def parsed_body(self) -> Any:
        """The body as the server parses it (None when it is not JSON)."""
        if self.raw is None:
            return self.body
        try:
            return json.loads(self.raw)
        except (ValueError, RecursionError):
            return None

    def describe(self, limit: int = 1500) -> str:
        body = compact(self.body) if self.raw is None else repr(self.raw[:300]) + (
            f"... ({len(self.raw)} bytes)" if len(self.raw) > 300 else "")
        text = f"{self.method} {self.path} [{self.mode}, auth={self.auth}, content-type={self.content_type}] {body}"
        return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def compact(value: Any) -> str:
    """JSON with long lists and strings abbreviated: readable reproducers of bodies that carry 576 floats."""
    def shrink(v: Any) -> Any:
        if isinstance(v, list) and len(v) > 8:
            kinds = {type(x).__name__ for x in v}
            return f"<list of {len(v)} {'/'.join(sorted(kinds))}: {json.dumps(v[:3])[:-1]}, ...>"
        if isinstance(v, list):
            return [shrink(x) for x in v]
        if isinstance(v, dict):
            return {k: shrink(x) for k, x in v.items()}
        if isinstance(v, str) and len(v) > 80:
            return f"<string of {len(v)} chars: {v[:20]!r}...>"
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**18:
            return f"<int of {len(str(abs(v)))} digits>"
        return v
    try:
        return json.dumps(shrink(value))
    except (ValueError, RecursionError):
        return repr(value)[:500]


# -- building blocks -----------------------------------------------------------------------------------------
LAYERS = st.integers(0, NUM_LAYERS - 1)
SEEDS = st.integers(0, 2**20)
SCALES = st.one_of(st.sampled_from([1.0, -1.0, 0.5, 4, 0.0]), st.floats(-8, 8, allow_nan=False, width=32))
VALID_NORMS = (0.0, 1e-3, 1.0, 8.0, 32.0)
# Finite in float32 but far past any residual stream: valid by the spec's letter (edge cases).
HUGE_NORMS = (1e35,)
SAE_SITE = (SAE_LAYER, "post_block")
POISON = [math.nan, math.inf, -math.inf, 1e39, -1e39, 10**400, "1.0", None, True, [1.0], {}]


def _values(seed: int, norm: float, size: int = HIDDEN) -> list[float]:
    return [0.0] * size if norm == 0 else vector(seed, norm, size)


def _hook_key(draw, hook: str) -> str:
    return draw(st.sampled_from([hook, TL_HOOKS[hook]]))


def _site_key(draw, layer: int, hook: str) -> str:
    return draw(st.sampled_from([f"{layer}.{hook}", f"blocks.{layer}.{TL_HOOKS[hook]}"]))


@dataclass(frozen=True)
class Tier:
    """A valid steering tier spec, the (layer, hook) sites it sets and the largest norm it adds."""

    spec: dict[str, Any]
    sites: frozenset[tuple[int, str]]
    strength: float


@st.composite
def steering_entry(draw, layer: int, hook: str, norms: tuple[float, ...]) -> tuple[Any, float]:
    """One entry (list, ``{vector}``, ``{vector, scale}``, or an SAE feature at the SAE's site) and its norm."""
    norm = draw(st.sampled_from(norms))
    forms = ["list", "vector", "scaled"] + (["sae"] if (layer, hook) == SAE_SITE else [])
    form = draw(st.sampled_from(forms))
    if form == "sae":
        scale = 0.0 if norm == 0 else draw(SCALES)
        return {"sae": SAE_NAME, "feature": draw(st.integers(0, SAE_FEATURES - 1)), "scale": scale}, abs(scale)
    values = _values(draw(SEEDS), norm)
    if form == "list":
        return values, norm
    if form == "vector":
        return {"vector": values}, norm
    scale = draw(SCALES)
    return {"vector": values, "scale": scale}, norm * abs(scale)


@st.composite
def steering_tier(draw, norms: tuple[float, ...] = VALID_NORMS) -> Tier:
    """A valid tier: 1-3 distinct sites, each hook's sites as a layer map (either hook spelling), whole site
    names (either spelling) or one packed block (float32 or bfloat16, optional scales)."""
    sites = draw(st.lists(st.tuples(LAYERS, st.sampled_from(HOOKS)), min_size=1, max_size=3, unique=True))
    spec: dict[str, Any] = {}
    strength = 0.0
    for hook in HOOKS:
        layers = sorted(layer for layer, h in sites if h == hook)
        if not layers:
            continue
        form = draw(st.sampled_from(["map", "sites", "packed"]))
        if form == "packed":
            norm = draw(st.sampled_from(norms))
            block = pack_vectors({layer: _values(draw(SEEDS), norm) for layer in layers},
                                 dtype=draw(st.sampled_from(["float32", "bfloat16"])))
            scales = [1.0] * len(layers)
            if draw(st.booleans()):
                scales = block["scales"] = [draw(SCALES) for _ in layers]
            spec[_hook_key(draw, hook)] = block
            strength = max(strength, norm * max(abs(s) for s in scales))
            continue
        for layer in layers:
            entry, norm = draw(steering_entry(layer, hook, norms))
            strength = max(strength, norm)
            if form == "map":
                spec.setdefault(_hook_key(draw, hook), {})[str(layer)] = entry
            else:
                spec[_site_key(draw, layer, hook)] = entry
    return Tier(spec, frozenset(sites), strength)


def zero_tier() -> st.SearchStrategy[Tier]:
    return steering_tier(norms=(0.0,))


@st.composite
def broken_tier(draw) -> Any:
    """A tier spec with one thing wrong, next to valid keys where the fault leaves room for them."""
    layer, hook = draw(LAYERS), draw(st.sampled_from(HOOKS))
    good = _values(draw(SEEDS), 8.0)
    kind = draw(st.sampled_from(["size", "poison", "layer", "hook", "not_object", "hook_value", "entry", "sae",
                                 "packed", "twice", "deep", "big"]))
    if kind == "size":
        bad = {hook: {str(layer): _values(1, 8.0, draw(st.sampled_from([1, 3, HIDDEN - 1, HIDDEN + 1])))}}
        if draw(st.integers(0, 4)) == 0:
            bad = {hook: {str(layer): []}}
    elif kind == "poison":
        poisoned = list(good)
        poisoned[draw(st.integers(0, HIDDEN - 1))] = draw(st.sampled_from(POISON))
        bad = {hook: {str(layer): poisoned}}
    elif kind == "layer":
        key = draw(st.sampled_from(["30", "-1", "1" + "0" * 30, "x", "1.5", "", " 3", "3 ", "0x1", "1e1", "+3"]))
        bad = {_hook_key(draw, hook): {key: good}}
    elif kind == "hook":
        key = draw(st.sampled_from(["mlp_out", "hook_resid", "Post_block", "", "blocks.3.hook_mlp_out",
                                    "3.post_blocks", "blocks.-1.hook_resid_post", "blocks.30.hook_resid_post",
                                    "30.post_block", "post_block.3", "blocks.3.hook_resid_post.x", " post_block"]))
        bad = {key: good if "." in key else {str(layer): good}}
    elif kind == "not_object":
        return draw(st.sampled_from([[], "post_block", 3, True, False, 0, [good], ""]))
    elif kind == "hook_value":
        bad = {_hook_key(draw, hook): draw(st.sampled_from([good, "x", 3, None, True, [[0.0]]]))}
    elif kind == "entry":
        entry = draw(st.sampled_from([
            {"vector": good, "scale": "x"}, {"vector": good, "scale": math.nan}, {"vector": good, "scale": 1e39},
            {"vector": good, "scale": 10**400}, {"vector": good, "scale": None}, {"vector": good, "extra": 1},
            {"scale": 2}, {}, "x", None, 3, {"vector": good[:7]}, {"vector": "x", "scale": 1},
        ]))
        bad = {_hook_key(draw, hook): {str(layer): entry}}
    elif kind == "sae":
        sae_layer, sae_hook, entry = SAE_LAYER, "post_block", draw(st.sampled_from([
            {"sae": "nosuch", "feature": 1}, {"sae": SAE_NAME, "feature": SAE_FEATURES},
            {"sae": SAE_NAME, "feature": -1}, {"sae": SAE_NAME, "feature": 1.5}, {"sae": SAE_NAME, "feature": "3"},
            {"sae": SAE_NAME, "feature": True}, {"sae": SAE_NAME}, {"sae": SAE_NAME, "feature": 1, "extra": 0},
            {"sae": SAE_NAME, "feature": 1, "scale": "x"}, {"sae": 3, "feature": 1},
            {"sae": SAE_NAME, "feature": 10**30}, {"sae": SAE_NAME, "feature": 1, "scale": 1e39},
        ]))
        if draw(st.booleans()):  # a valid feature at a site the SAE does not read
            sae_layer, sae_hook = draw(st.sampled_from([(SAE_LAYER - 1, "post_block"), (SAE_LAYER, "pre_attn")]))
            entry = {"sae": SAE_NAME, "feature": 1, "scale": 2.0}
        bad = {_hook_key(draw, sae_hook): {str(sae_layer): entry}}
    elif kind == "packed":
        bad = {_hook_key(draw, hook): draw(broken_packed(layer))}
    elif kind == "twice":
        bad = draw(st.sampled_from([
            {"post_block": {str(layer): good}, "hook_resid_post": {str(layer): good}},
            {f"blocks.{layer}.hook_resid_post": good, f"{layer}.post_block": good},
            {"post_block": {str(layer): good, f"0{layer}": good}},
            {"pre_attn": {str(layer): good}, f"{layer}.pre_attn": good},
        ]))
    elif kind == "deep":  # deeper than a vector, within the server's body depth bound (raw_cases go past it)
        nested: Any = good[:2]
        for _ in range(draw(st.sampled_from([3, 30, 100]))):
            nested = [nested]
        bad = {hook: {str(layer): nested}}
    else:  # big: a megabyte of floats where 576 belong
        bad = {hook: {str(layer): good * 200}}
    if draw(st.booleans()):  # valid sites beside the broken one: the error must still name the tier's field
        bad = {**draw(steering_tier()).spec, **bad}
    return bad


@st.composite
def broken_packed(draw, layer: int) -> dict[str, Any]:
    """The compact form with one field wrong (or duplicated layers, which a dict of rows would silently
    collapse into one)."""
    good = pack_vectors({layer: _values(draw(SEEDS), 8.0)})
    fault = draw(st.sampled_from(["dtype", "shape", "layers", "data", "scales", "extra", "missing", "duplicate"]))
    if fault == "dtype":
        return {**good, "dtype": draw(st.sampled_from(["float16", "f32", None, 3, "FLOAT32"]))}
    if fault == "shape":
        return {**good, "shape": draw(st.sampled_from([[1, HIDDEN - 1], [2, HIDDEN], [HIDDEN], [1, HIDDEN, 1], "x",
                                                       None, [-1, HIDDEN], [0, HIDDEN]]))}
    if fault == "layers":
        return {**good, "layers": draw(st.sampled_from([[NUM_LAYERS], [-1], [], ["x"], None, [10**30]]))}
    if fault == "data":
        data = good["data"]
        return {**good, "data": draw(st.sampled_from(["%%", "A", data[:-4], data + "AAAA", 3, None, "", " " + data]))}
    if fault == "scales":
        return {**good, "scales": draw(st.sampled_from([[1.0, 1.0], ["x"], [math.nan], [None], "x", [], [math.inf]]))}
    if fault == "extra":
        return {**good, "extra": 1}
    if fault == "missing":
        missing = draw(st.sampled_from(["dtype", "shape", "layers"]))
        return {k: v for k, v in good.items() if k != missing}
    other = (layer + 1) % NUM_LAYERS
    rows = pack_vectors({layer: _values(1, 8.0), other: _values(2, 8.0)})
    return {**rows, "layers": [layer, layer]}


BAD_NAMES = ["nosuch", "", "FORMAL", "formal ", 3, [], {}, True, "../x", "x" * 10_000]
# Names no name syntax should take: path separators and traversal, control characters, empty or blank, huge.
SUSPICIOUS_NAMES = ["../x", "a/b", "/abs", "x" * 10_000, "a\x00b", "a\nb", " ", "\t", ".."]


# -- capture ------------------------------------------------------------------------------------------------
@st.composite
def capture_hooks(draw) -> Any:
    form = draw(st.sampled_from(["all", "map", "map", "sites", "sites"]))
    if form == "all":
        return "all"
    if form == "sites":
        sites = draw(st.lists(st.tuples(LAYERS, st.sampled_from(HOOKS)), min_size=1, max_size=3, unique=True))
        return [_site_key(draw, layer, hook) for layer, hook in sites]
    hooks = draw(st.lists(st.sampled_from(HOOKS), min_size=1, max_size=2, unique=True))
    return {_hook_key(draw, hook): draw(st.one_of(st.just("all"), st.lists(LAYERS, min_size=1, max_size=3,
                                                                                unique=True)))
            for hook in hooks}


POSITIONS = st.one_of(st.sampled_from(["last_prompt", "all_prompt", "all_generated", "all"]),
                      st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True))
SAE_HOOKS = [{"post_block": [SAE_LAYER]}, {"hook_resid_post": [SAE_LAYER]}, [f"blocks.{SAE_LAYER}.hook_resid_post"],
             [f"{SAE_LAYER}.post_block"]]


@st.composite
def capture_entry(draw, consumer: str) -> dict[str, Any]:
    """A valid spec for one consumer, with that consumer's own options."""
    entry: dict[str, Any] = {}
    if consumer == "sae_features":
        if draw(st.booleans()):
            entry["hooks"] = draw(st.sampled_from(SAE_HOOKS))
        if draw(st.booleans()):
            entry["sae"] = SAE_NAME
        if draw(st.booleans()):
            entry["k"] = draw(st.integers(1, SAE_FEATURES))
    elif draw(st.integers(0, 3)):
        entry["hooks"] = draw(capture_hooks())
    if draw(st.booleans()):
        entry["positions"] = draw(POSITIONS)
    if draw(st.booleans()):
        entry["naming"] = draw(st.sampled_from(["vllm_interp", "transformer_lens"]))
    if consumer == "patch_source":
        entry["tag"] = draw(st.sampled_from(RUN_TAGS))
    elif draw(st.booleans()):
        entry["tag"] = draw(st.sampled_from(FILE_TAGS))
    if consumer == "filesystem":
        if draw(st.booleans()):
            entry["layout"] = draw(st.sampled_from(["packed", "per_file", "sharded"]))
        if draw(st.booleans()):
            entry["on_collision"] = draw(st.sampled_from(["error", "overwrite", "suffix"]))
    if consumer == "activation_stats" and draw(st.booleans()):
        entry["note"] = "fuzz " + draw(st.text(max_size=40))
    return entry


@st.composite
def capture_spec(draw, consumers: tuple[str, ...]) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(consumers), min_size=1, max_size=2, unique=True))
    return {name: draw(capture_entry(name)) for name in names}


ENTRY_FAULTS: dict[str, list[Any]] = {
    "hooks": [{"mlp_out": [1]}, {"post_block": [NUM_LAYERS]}, {"post_block": [-1]}, {"post_block": []}, {}, [],
              ["blocks.1.hook_mlp_out"], ["3.post_blocks"], [3], "none", {"post_block": "some"}, {"post_block": 3},
              {"hook_resid_post": [1], "post_block": [2]}, {"post_block": [1.5]}, {"post_block": [10**30]},
              {"post_block": ["x"]}, None, [None]],
    "positions": [[-1], [], [1, 1], "first", [1.5], 1, ["x"], [True], None, {"a": 1}],
    "tag": ["../x", "/abs", "a//b", "", ".", "a/../b", "x" * 300, 3, "a b", "é", "a/", "-a", ["a"]],
    "naming": ["tl", 3, None, "TransformerLens"],
}
CONSUMER_FAULTS: dict[str, list[tuple[str, Any]]] = {
    "inline": [("foo", 1), ("layout", "packed")],
    "patch_source": [("foo", 1)],
    "logging": [("foo", 1)],
    "filesystem": [("layout", "zip"), ("layout", 3), ("layout", None), ("on_collision", "ignore"), ("foo", 1)],
    "activation_stats": [("note", 3), ("note", "x" * 201), ("note", ["a"]), ("foo", 1)],
    "sae_features": [("k", 0), ("k", SAE_FEATURES + 1), ("k", True), ("k", "3"), ("k", 1.5), ("k", None),
                     ("sae", "nosuch"), ("sae", 3), ("hooks", {"post_block": [SAE_LAYER - 1]}),
                     ("hooks", [f"blocks.{SAE_LAYER}.hook_resid_pre"])],
}


@st.composite
def broken_capture(draw, consumers: tuple[str, ...], disabled: tuple[str, ...]) -> Any:
    """A capture field with one thing wrong: its shape, a consumer's name, or one consumer's spec."""
    kind = draw(st.sampled_from(["top", "consumer", "entry", "entry", "entry", "option", "option"]))
    if kind == "top":
        return draw(st.sampled_from([[], "all", 3, True, {}, ["inline"]]))
    spec = draw(capture_spec(consumers))
    if kind == "consumer":
        return {**spec, draw(st.sampled_from(["nosuch", "", "INLINE", *disabled])): {}}
    name = draw(st.sampled_from(sorted(spec)))
    if kind == "entry":
        if draw(st.integers(0, 5)) == 0:
            return {**spec, name: draw(st.sampled_from([[], "x", None, 3]))}
        key = draw(st.sampled_from(sorted(ENTRY_FAULTS)))
        return {**spec, name: {**spec[name], key: draw(st.sampled_from(ENTRY_FAULTS[key]))}}
    key, value = draw(st.sampled_from(CONSUMER_FAULTS[name]))
    return {**spec, name: {**spec[name], key: value}}


# -- patch --------------------------------------------------------------------------------------------------
@st.composite
def patch_entry_source(draw) -> dict[str, Any]:
    kind = draw(st.sampled_from(["zeros", "vector", "run", "run"]))
    if kind == "zeros":
        return {"zeros": True}
    if kind == "run":
        return {"run": CLEAN_RUN, "position": draw(st.integers(0, PROMPT_TOKENS - 1))}
    values = _values(draw(SEEDS), draw(st.sampled_from([0.0, 1.0, 8.0])))
    return {"vector": draw(st.sampled_from([values, {"vector": values, "scale": 0.5}]))}


@st.composite
def patch_list(draw) -> list[dict[str, Any]]:
    """1-3 entries at distinct (layer, hook, prompt position) cells, sites in every spelling."""
    cells = draw(st.lists(st.tuples(LAYERS, st.sampled_from(HOOKS), st.integers(0, PROMPT_TOKENS - 1)),
                          min_size=1, max_size=3, unique=True))
    entries = []
    for layer, hook, position in cells:
        entry: dict[str, Any] = {}
        if draw(st.booleans()):
            entry["site"] = _site_key(draw, layer, hook)
        else:
            entry["layer"], entry["hook"] = layer, _hook_key(draw, hook)
        entry["position"] = position
        if draw(st.booleans()):
            entry["alpha"] = draw(st.one_of(st.sampled_from([0, 1, 0.5, 1.0]), st.floats(0, 1)))
        entry["source"] = draw(patch_entry_source())
        entries.append(entry)
    return entries


PATCH_ENTRY_FAULTS: dict[str, list[Any]] = {
    "site": ["blocks.2.mlp_out", "3.post_blocks", "", 3, None, f"blocks.{NUM_LAYERS}.hook_resid_post",
             f"{NUM_LAYERS}.post_block", "post_block"],
    "layer": [NUM_LAYERS, -1, True, 1.5, "1", None, 10**30],
    "hook": ["mlp_out", "", 3, None, ["post_block"]],
    "position": [-1, True, 1.5, "1", None],
    "alpha": [1.5, -0.1, math.nan, math.inf, "0.5", True, None, 10**400],
    "source": ["x", None, {}, {"zeros": True, "vector": [0.0] * HIDDEN}, {"zeros": True, "extra": 1},
               {"zeros": False}, {"zeros": 1}, {"zeros": "true"}, {"vector": [0.0] * 3},
               {"vector": [math.nan] * HIDDEN}, {"vector": [10**400] * HIDDEN},
               {"vector": {"vector": [1.0] * HIDDEN, "scale": 10**400}}, {"run": "nosuch", "position": 0},
               {"run": "", "position": 0}, {"run": 3, "position": 0}, {"run": CLEAN_RUN},
               {"run": CLEAN_RUN, "position": -1}, {"run": CLEAN_RUN, "position": True},
               {"run": CLEAN_RUN, "position": 0, "scale": 1}],
}


def _layer_and_hook(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry with its site given as ``layer`` and ``hook``."""
    if "site" in entry:
        entry["layer"], entry["hook"] = parse_site_name(entry.pop("site"))
    return entry


@st.composite
def broken_patch(draw) -> Any:
    kind = draw(st.sampled_from(["top", "entry", "field", "field", "field", "site_and_layer", "missing", "extra",
                                 "twice", "many"]))
    if kind == "top":
        return draw(st.sampled_from([{}, "x", 3, True, False, {"layer": 1}, [[]]]))
    if kind == "many":
        return [{"layer": i % NUM_LAYERS, "hook": HOOKS[i // NUM_LAYERS % 3], "position": i // 90,
                 "source": {"zeros": True}} for i in range(1025)]
    entries = draw(patch_list())
    i = draw(st.integers(0, len(entries) - 1))
    if kind == "twice":  # the same cell again, perhaps under another spelling
        return [*entries, dict(entries[i])]
    entry = _layer_and_hook(dict(entries[i]))
    if kind == "entry":
        entries[i] = draw(st.sampled_from(["x", 3, None, [], [1]]))
        return entries
    if kind == "field":
        key = draw(st.sampled_from(sorted(PATCH_ENTRY_FAULTS)))
        if key == "site":
            del entry["layer"], entry["hook"]
        entry[key] = draw(st.sampled_from(PATCH_ENTRY_FAULTS[key]))
    elif kind == "site_and_layer":
        entry["site"] = f"{entry['layer']}.{entry['hook']}"
    elif kind == "missing":
        del entry[draw(st.sampled_from(["position", "source", "layer", "hook"]))]
    else:
        entry[draw(st.sampled_from(["extra", "scale", "run", "Layer"]))] = 1
    entries[i] = entry
    return entries


# -- the generation endpoints --------------------------------------------------------------------------------
@dataclass
class _Fields:
    """Our fields on one generation body, and what a valid set of them must visibly do."""

    values: dict[str, Any] = field(default_factory=dict)
    strength: dict[str, float] = field(default_factory=dict)  # tier -> largest norm


@st.composite
def generation_fields(draw, consumers: tuple[str, ...]) -> _Fields:
    out = _Fields()
    for name in STEERING_TIER_FIELDS:
        if draw(st.integers(0, 3)) == 0:
            tier = draw(steering_tier())
            out.values[name], out.strength[name] = tier.spec, tier.strength
    if draw(st.integers(0, 5)) == 0:
        out.values["steering_name"] = PRELOADED_NAME
        out.strength["steering_vectors"] = max(out.strength.get("steering_vectors", 0.0), 8.0)
    if draw(st.integers(0, 2)) == 0:
        out.values["capture"] = draw(capture_spec(consumers))
    if draw(st.integers(0, 3)) == 0:
        out.values["patch"] = draw(patch_list())
    return out


@st.composite
def _vllm_side(draw, path: str, *, single: bool, stream_ok: bool) -> dict[str, Any]:
    """The vLLM part of a generation body: prompt form, max_tokens, n, stream, logprobs."""
    body: dict[str, Any] = {"max_tokens": draw(st.integers(1, 3)), "temperature": 0}
    if path == COMPLETIONS:
        forms = [PROMPT, [PROMPT], PROMPT_IDS, [PROMPT_IDS]] + ([] if single else [[PROMPT, CORRUPT],
                                                                                 [PROMPT_IDS, CORRUPT_IDS]])
        body["prompt"] = draw(st.sampled_from(forms))
        body["logprobs"] = 1
    elif path == CHAT_COMPLETIONS:
        body["messages"] = CHAT
        body["logprobs"] = True
    else:
        body["messages"] = [CHAT] if single else draw(st.sampled_from([[CHAT], [CHAT, CHAT]]))
    if path != CHAT_BATCH and not single and draw(st.integers(0, 3)) == 0:
        body.update(n=2, temperature=0.8, seed=draw(st.integers(0, 9)))
    if path != CHAT_BATCH and stream_ok and draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


def _visible_steering(fields: _Fields, body: dict[str, Any]) -> bool:
    """Whether the request's steering must move a greedy single-completion output (compared with the same
    request unsteered): a strong base/prefill vector moves the first token; a decode one the second."""
    if body.get("stream") or body.get("n", 1) != 1 or "patch" in fields.values:
        return False
    if body.get("prompt") in ([PROMPT, CORRUPT], [PROMPT_IDS, CORRUPT_IDS]):
        return False
    strong = {tier for tier, norm in fields.strength.items() if norm >= VISIBLE_NORM}
    return bool(strong - {"decode_steering_vectors"}) or ("decode_steering_vectors" in strong
                                                          and body["max_tokens"] >= 2)


CONSTRAINT_FAULTS = ("capture_n", "capture_prompts", "patch_stream", "patch_n", "patch_prompts", "patch_media")


@st.composite
def generation_cases(draw, consumers: tuple[str, ...], disabled: tuple[str, ...] = ()) -> Case:
    path = draw(st.sampled_from([COMPLETIONS, COMPLETIONS, CHAT_COMPLETIONS, CHAT_BATCH]))
    mode = draw(st.sampled_from(["valid", "valid", "broken", "broken", "broken", "broken", "edge", "random"]))
    endpoint = f"POST {path}"
    if mode == "random":
        body = draw(_vllm_side(path, single=True, stream_ok=True))
        for name in GENERATION_FIELDS:
            if draw(st.booleans()):
                body[name] = draw(json_values())
        return Case(endpoint, path, mode, body=body)
    fields = draw(generation_fields(consumers))
    broken, tolerate = None, None
    if mode == "broken":
        targets = [*GENERATION_FIELDS, "vllm_xargs", *(CONSTRAINT_FAULTS if path != CHAT_BATCH else ())]
        broken = draw(st.sampled_from(targets))
        if broken in STEERING_TIER_FIELDS:
            fields.values[broken] = draw(broken_tier())
        elif broken == "steering_name":
            fields.values[broken] = draw(st.sampled_from(BAD_NAMES))
        elif broken == "capture":
            fields.values[broken] = draw(broken_capture(consumers, disabled))
        elif broken == "patch":
            fields.values[broken] = draw(broken_patch())
        elif broken.startswith(("capture_", "patch_")):
            name = broken.split("_")[0]
            fields.values.pop("patch" if name == "capture" else "capture", None)
            fields.values[name] = draw(capture_spec(consumers) if name == "capture" else patch_list())
        fields.strength.clear()
    elif mode == "edge":
        broken = draw(st.sampled_from(["steering_vectors", "capture", "patch"]))
        fields.values[broken] = draw(edge_value(broken, consumers))
        fields.strength.clear()
    # A third of the valid requests probe steering's effect: a strong tier, unstreamed, nothing patched.
    probe = mode == "valid" and path != CHAT_BATCH and draw(st.integers(0, 2)) == 0
    if probe:
        fields.values.pop("patch", None)
        tier_name = draw(st.sampled_from(STEERING_TIER_FIELDS))
        tier = draw(steering_tier(norms=(8.0, 32.0)))
        fields.values[tier_name], fields.strength[tier_name] = tier.spec, tier.strength
    single = "capture" in fields.values or "patch" in fields.values
    body = draw(_vllm_side(path, single=single and broken not in CONSTRAINT_FAULTS,
                           stream_ok="patch" not in fields.values and not probe))
    if broken in CONSTRAINT_FAULTS:
        _break_constraint(body, broken, path)
        broken = broken.split("_")[0]
    if broken == "vllm_xargs":
        body["vllm_xargs"] = {"vllm_interp": draw(st.sampled_from(["{}", '{"capture": {}}', "x"]))}
    if mode != "broken" and "patch" in fields.values:
        tolerate = {409: "patch"}
    body.update(fields.values)
    if path == CHAT_BATCH:  # vLLM's batch endpoint takes none of our fields: each is refused, naming one
        ours = sorted(name for name in (*GENERATION_FIELDS, "vllm_xargs") if name in body)
        return Case(endpoint, path, "broken" if ours else "valid", body=body, broken=ours[0] if ours else None,
                    also=tuple(ours[1:]))
    effect = Effect("steering") if mode == "valid" and _visible_steering(fields, body) else None
    return Case(endpoint, path, mode, body=body, broken=broken, tolerate=tolerate or {}, effect=effect)


def _break_constraint(body: dict[str, Any], fault: str, path: str) -> None:
    """Make a valid capture/patch request break one of their request-level rules (a patch also refuses a
    stream, so the other rules are broken on unstreamed bodies)."""
    rule = fault.split("_")[1]
    if rule == "stream":
        body["stream"] = True
        return
    body.pop("stream", None)
    body.pop("stream_options", None)
    if rule == "media" and path == CHAT_COMPLETIONS:
        body["messages"] = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]
    elif rule in ("prompts", "media") and path == COMPLETIONS:
        body["prompt"] = [PROMPT, CORRUPT]
    else:  # n, or one chat conversation per request
        body.update(n=2, temperature=0.8, seed=0)


@st.composite
def edge_value(draw, name: str, consumers: tuple[str, ...]) -> Any:
    """Valid by the letter of the spec, at its edges: huge but finite vectors, lax layer spellings (``03``,
    non-ASCII digits), capture positions never computed or past int64, patches past the prompt."""
    if name == "steering_vectors":
        layer = draw(LAYERS)
        return draw(st.one_of(steering_tier(HUGE_NORMS).map(lambda tier: tier.spec), st.sampled_from([
            {"post_block": {f"0{layer}": _values(1, 8.0)}},
            {"post_block": {"٣": _values(1, 8.0)}},
            {f"blocks.0{layer}.hook_resid_post": _values(1, 8.0)},
            {"post_block": {str(layer): [3.0e38] * HIDDEN}},
            {"post_block": {str(layer): {"vector": _values(1, 8.0), "scale": 1e30}}},
        ])))
    if name == "capture":
        consumer = draw(st.sampled_from([c for c in consumers if c not in ("sae_features", "patch_source")]))
        return {consumer: draw(st.sampled_from([
            {"positions": [10**30]}, {"positions": [2**63]}, {"positions": [2**63 - 1]}, {"positions": [500]},
            {"hooks": {"post_block": ["1"]}}, {"hooks": {"post_block": [True]}}, {"hooks": {"post_block": [1, 1]}},
            {"hooks": {"post_block": [1.0]}}, {"hooks": ["blocks.01.hook_resid_post"]},
        ]))}
    entry = draw(patch_list())[0]
    fault = draw(st.sampled_from(["position", "run_position", "alpha"]))
    if fault == "position":
        entry["position"] = draw(st.sampled_from([PROMPT_TOKENS, 100, 10**30, 2**63]))
    elif fault == "run_position":
        entry["source"] = {"run": CLEAN_RUN, "position": draw(st.sampled_from([PROMPT_TOKENS, 10**30]))}
    else:
        entry["alpha"] = draw(st.sampled_from([0, 0.0, 1, 5e-324, 1 - 1e-16]))
    return [entry]


# -- random JSON -------------------------------------------------------------------------------------------
# Keys and strings that reach deep into our validators more often than random text would.
KEYWORDS = ["hooks", "positions", "tag", "naming", "layer", "hook", "site", "position", "alpha", "source", "run",
            "zeros", "vector", "scale", "feature", "dtype", "shape", "layers", "data", "scales", "inline",
            "filesystem", "activation_stats", "patch_source", "post_block", "hook_resid_post", "pre_attn",
            "blocks.3.hook_resid_post", "3.post_block", "0", "6", "all", "last_prompt", CLEAN_RUN, "float32"]


def json_values(keywords: tuple[str, ...] = tuple(KEYWORDS)) -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
                       st.sampled_from(keywords))
    keys = st.one_of(st.text(max_size=8), st.sampled_from(keywords))
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                        max_leaves=16)


# -- /v1/steering/* --------------------------------------------------------------------------------------------
AUTH = st.sampled_from(["bearer"] * 14 + ["x-api-key"] * 2 + ["env-key", None, "wrong-key"])
NOT_OBJECTS = [[], "x", 3, None, True, [{"name": "fuzz-a"}]]


@st.composite
def steering_set_cases(draw) -> Case:
    path = "/v1/steering/set"
    mode = draw(st.sampled_from(["valid", "broken", "broken", "broken", "random"]))
    auth = draw(AUTH)
    if mode == "random":
        body = draw(st.dictionaries(st.sampled_from([*ENDPOINT_FIELDS[path], "foo"]), json_values(), max_size=3))
        return Case(f"POST {path}", path, mode, body=body, auth=auth, needs_key=True)
    tiers = {name: draw(zero_tier()) for name in GLOBAL_TIER_FIELDS if draw(st.booleans())}
    body: dict[str, Any] = {name: tier.spec for name, tier in tiers.items()}
    if draw(st.booleans()):
        body["replace"] = draw(st.booleans())
    if mode == "valid":
        return Case(f"POST {path}", path, mode, body=body, auth=auth, needs_key=True,
                    effect=Effect("global_set", {name: tier.sites for name, tier in tiers.items()}))
    broken = draw(st.sampled_from([*GLOBAL_TIER_FIELDS, "replace", "extra", "body"]))
    if broken in GLOBAL_TIER_FIELDS:
        body[broken] = draw(broken_tier())
    elif broken == "replace":
        body["replace"] = draw(st.sampled_from(["maybe", 2, None, [], {}]))
    elif broken == "extra":
        broken = draw(st.sampled_from(["steering_vectors", "name", "foo", "Vectors"]))
        body[broken] = {}
    else:
        body = draw(st.sampled_from(NOT_OBJECTS))
    return Case(f"POST {path}", path, mode, body=body, auth=auth, needs_key=True, broken=broken)


@st.composite
def steering_clear_cases(draw) -> Case:
    """No body or ``{}`` (valid), or any JSON (random: a refusal must still be a JSON 4xx)."""
    path = "/v1/steering/clear"
    auth = draw(AUTH)
    if draw(st.booleans()):
        return Case(f"POST {path}", path, "valid", body=draw(st.sampled_from([None, {}])), auth=auth, needs_key=True,
                    effect=Effect("cleared"))
    return Case(f"POST {path}", path, "random", body=draw(json_values()), auth=auth, needs_key=True)


@st.composite
def register_cases(draw) -> Case:
    path = "/v1/steering/vectors/register"
    mode = draw(st.sampled_from(["valid", "broken", "broken", "broken", "random"]))
    auth = draw(AUTH)
    if mode == "random":
        body = draw(st.dictionaries(st.sampled_from([*ENDPOINT_FIELDS[path], "foo"]),
                                    json_values(tuple([*KEYWORDS, *NAMES])), max_size=3))
        return Case(f"POST {path}", path, mode, body=body, auth=auth, needs_key=True)
    name = draw(st.sampled_from(NAMES))
    tiers = draw(st.lists(st.sampled_from(GLOBAL_TIER_FIELDS), min_size=1, max_size=3, unique=True))
    body: dict[str, Any] = {"name": name, **{tier: draw(steering_tier()).spec for tier in tiers}}
    if mode == "valid":
        return Case(f"POST {path}", path, mode, body=body, auth=auth, needs_key=True, effect=Effect("registered", name))
    broken = draw(st.sampled_from(["name", "name", "vectors", *GLOBAL_TIER_FIELDS, "extra", "body"]))
    if broken == "name":
        choice = draw(st.sampled_from(["missing", "type", "suspicious"]))
        if choice == "missing":
            body.pop("name")
        else:
            body["name"] = draw(st.sampled_from([3, None, "", [], {"a": 1}] if choice == "type" else SUSPICIOUS_NAMES))
    elif broken == "vectors":  # nothing to register
        body = {"name": name, **draw(st.dictionaries(st.sampled_from(GLOBAL_TIER_FIELDS), st.just({})))}
    elif broken in GLOBAL_TIER_FIELDS:
        body[broken] = draw(broken_tier())
    elif broken == "extra":
        broken = draw(st.sampled_from(["steering_vectors", "foo", "replace"]))
        body[broken] = {}
    else:
        body = draw(st.sampled_from(NOT_OBJECTS))
    return Case(f"POST {path}", path, mode, body=body, auth=auth, needs_key=True, broken=broken)


@st.composite
def unregister_cases(draw) -> Case:
    path = "/v1/steering/vectors/unregister"
    mode = draw(st.sampled_from(["valid", "valid", "broken"]))
    auth = draw(AUTH)
    if mode == "valid":
        name = draw(st.sampled_from(NAMES))
        return Case(f"POST {path}", path, mode, body={"name": name}, auth=auth, needs_key=True,
                    tolerate={400: "name"}, effect=Effect("unregistered", name))
    broken = draw(st.sampled_from(["name", "extra", "body"]))
    body: Any = {"name": draw(st.sampled_from(NAMES))}
    if broken == "name":
        body = draw(st.sampled_from([{}, {"name": 3}, {"name": None}, {"name": ""}, {"name": ["fuzz-a"]},
                                     {"name": "x" * 10_000}]))
    elif broken == "extra":
        broken = "foo"
        body["foo"] = 1
    else:
        body = draw(st.sampled_from(NOT_OBJECTS))
    return Case(f"POST {path}", path, mode, body=body, auth=auth, needs_key=True, broken=broken)


CONTRASTIVE_PROMPTS = ["I love this", "What a wonderful day", "I hate this", "What an awful day"]
CONTRASTIVE_FAULTS: dict[str, list[Any]] = {
    "positive": [[], "x", [""], [3], None, [["I love this"]]],
    "negative": [[], 3, [""], [None]],
    "layers": [[], [NUM_LAYERS], [-1], [1, 1], ["1"], [True], "none", 3, None, [1.5]],
    "hook": ["mlp_out", 3, None, "blocks.3.hook_resid_post"],
    "positions": ["all", "last", 3, None],
    "normalize": ["maybe", 2, None, []],
    "name": ["", 3, [], *SUSPICIOUS_NAMES],
}


@st.composite
def contrastive_cases(draw) -> Case:
    path = "/v1/steering/vectors/contrastive"
    mode = draw(st.sampled_from(["valid", "valid", "broken", "broken", "broken", "edge"]))
    auth = draw(AUTH)
    body: dict[str, Any] = {
        "positive": draw(st.lists(st.sampled_from(CONTRASTIVE_PROMPTS[:2]), min_size=1, max_size=2)),
        "negative": draw(st.lists(st.sampled_from(CONTRASTIVE_PROMPTS[2:]), min_size=1, max_size=2)),
        "layers": draw(st.one_of(st.lists(LAYERS, min_size=1, max_size=2, unique=True), st.just("all"))),
    }
    if draw(st.booleans()):
        hook = draw(st.sampled_from(HOOKS))
        body["hook"] = _hook_key(draw, hook)
    if draw(st.booleans()):
        body["positions"] = draw(st.sampled_from(["last_prompt", "mean_prompt"]))
    if draw(st.booleans()):
        body["normalize"] = draw(st.booleans())
    if draw(st.integers(0, 2)) == 0:
        body["name"] = draw(st.sampled_from(NAMES))
    broken = None
    if mode == "broken":
        broken = draw(st.sampled_from([*CONTRASTIVE_FAULTS, "layers_missing", "extra", "body"]))
        if broken == "layers_missing":
            broken = "layers"
            body.pop("layers")
        elif broken == "extra":
            broken = "foo"
            body["foo"] = 1
        elif broken == "body":
            body = draw(st.sampled_from(NOT_OBJECTS))
        else:
            body[broken] = draw(st.sampled_from(CONTRASTIVE_FAULTS[broken]))
    elif mode == "edge":  # a prompt longer than the model's context: refused, naming the prompts
        broken = draw(st.sampled_from(["positive", "negative"]))
        body[broken] = ["word " * 600]
    named = isinstance(body, dict) and body.get("name") is not None
    effect = Effect("contrastive", body) if mode == "valid" else None
    return Case(f"POST {path}", path, mode, body=body, auth=auth, needs_key=named, broken=broken,
                tolerate={400: "normalize"} if mode == "valid" else {}, effect=effect)


# -- patch sources and sweeps --------------------------------------------------------------------------------
@st.composite
def patch_source_cases(draw) -> Case:
    if draw(st.integers(0, 2)) == 0:
        query = draw(st.sampled_from(["", "?x=1", "?run_id=../x", "?" + "a" * 3000]))
        return Case("GET /v1/patch_sources", "/v1/patch_sources" + query, "valid", method="GET", content_type=None,
                    effect=Effect("sources_listed"))
    run_id = draw(st.one_of(st.sampled_from(RUN_TAGS), st.sampled_from(
        ["nosuch", "", "../x", "a/../../b", "%2e%2e", "x" * 10_000, "a b", "é", "fuzz-run-0/x", " "]),
        st.text(min_size=1, max_size=20)))
    valid = run_id in RUN_TAGS
    return Case("DELETE /v1/patch_sources/{run_id}", "/v1/patch_sources/" + quote(run_id, safe=""),
                "valid" if valid else "broken", method="DELETE", content_type=None, auth=draw(AUTH), needs_key=True,
                broken=None if valid else "run_id", tolerate={404: "run_id"} if valid else {},
                effect=Effect("deleted", run_id) if valid else None)


SWEEP_FAULTS: dict[str, list[Any]] = {
    "prompt": ["", [], [10**6], [-1], 3, None, [1.5], ["x"]],
    "clean_prompt": ["", 3, [10**6]],
    "hooks": [["mlp_out"], [], "post_block", [None]],
    "layers": [[NUM_LAYERS], [-1], [], {"start": 0, "stop": 30, "step": 0}, {"start": 5, "stop": 2}, ["1"], [True],
               {"start": 0, "foo": 1}, "some", [1.5]],
    "positions": [[10], [-1], {"span": "Spain"}, {"span": "Italy", "occurrence": 3}, {"span": ""}, "all", [],
                  {"span": 3}],
    "alpha": [1.5, -1, "x", math.nan, None, 10**400],
    "answer_token": [" Par is", "", 3],
    "answer_token_id": [-1, 10**6, 1.5, True, "7042"],
    "metric": ["nosuch", 3, None],
    "stream": ["maybe", 2],
}


@st.composite
def sweep_cases(draw) -> Case:
    path = "/v1/patch_sweep"
    mode = draw(st.sampled_from(["valid", "valid", "broken", "broken", "broken", "broken", "edge", "random"]))
    if mode == "random":
        body = draw(st.dictionaries(st.sampled_from([*ENDPOINT_FIELDS[path], "foo"]), json_values(), max_size=5))
        return Case(f"POST {path}", path, mode, body=body)
    body: dict[str, Any] = {"prompt": draw(st.sampled_from([CORRUPT, CORRUPT_IDS]))}
    source = draw(st.sampled_from(["clean_prompt", "source_run", "ablate"]))
    body[source] = {"clean_prompt": draw(st.sampled_from([PROMPT, PROMPT_IDS])), "source_run": CLEAN_RUN,
                    "ablate": True}[source]
    hooks = draw(st.lists(st.sampled_from(HOOKS), min_size=1, max_size=2, unique=True))
    spelled = [_hook_key(draw, hook) for hook in hooks]
    form = draw(st.sampled_from(["hooks", "hook", "none"] if len(hooks) == 1 else ["hooks"]))
    if form == "hooks":
        body["hooks"] = spelled
    elif form == "hook":
        body["hook"] = spelled[0]
    else:
        hooks = ["post_block"]
    start = draw(st.integers(0, NUM_LAYERS - 2))
    body["layers"] = draw(st.sampled_from([[start], [start, start + 1], {"start": start, "stop": start + 2},
                                           {"start": start, "stop": NUM_LAYERS, "step": 15}]))
    if draw(st.booleans()):
        body["positions"] = draw(st.sampled_from([[3], [0, 4], {"span": "Italy"}, "all_prompt"]))
    if draw(st.booleans()):
        body["answer_token"] = " Paris"
    else:
        body["answer_token_id"] = draw(st.sampled_from([7042, 0, 49151]))
    if draw(st.booleans()):
        body["foil_token"] = " Rome"
    metrics = ["logprob"] + (["logit_diff"] if "foil_token" in body else []) + (
        ["recovered"] if source == "clean_prompt" else [])
    if draw(st.booleans()):
        body["metric"] = draw(st.sampled_from(metrics))
    if draw(st.booleans()):
        body["alpha"] = draw(st.floats(0, 1))
    if draw(st.integers(0, 2)) == 0:
        body["stream"] = True
    if isinstance(body["prompt"], list) and body.get("positions", {}) == {"span": "Italy"}:
        body["positions"] = [3]
    broken = None
    if mode == "broken":
        broken = draw(st.sampled_from([*SWEEP_FAULTS, "sources", "both_hooks", "both_answers", "no_answer",
                                       "unknown_run", "extra", "body", "cells"]))
        if broken == "body":
            return Case(f"POST {path}", path, mode, body=draw(st.sampled_from(NOT_OBJECTS)), broken=broken)
        _break_sweep(draw, body, broken)
        broken = {"sources": "clean_prompt", "both_hooks": "hooks", "both_answers": "answer_token",
                  "no_answer": "answer_token", "unknown_run": "source_run", "extra": "foo", "cells": "layers"
                  }.get(broken, broken)
    elif mode == "edge":  # a prompt past the model's context, one cell: refused naming the prompt
        broken = "prompt"
        body.update(prompt="word " * 600, layers=[0], positions=[0])
        body.pop("clean_prompt", None), body.pop("source_run", None)
        body["ablate"] = True
        body["metric"] = "logprob"
    effect = Effect("sweep", {"hooks": hooks, "stream": bool(body.get("stream"))}) if mode == "valid" else None
    return Case(f"POST {path}", path, mode, body=body, broken=broken, effect=effect)


def _break_sweep(draw, body: dict[str, Any], fault: str) -> None:
    if fault in SWEEP_FAULTS:
        body[fault] = draw(st.sampled_from(SWEEP_FAULTS[fault]))
        if fault == "clean_prompt":
            body.pop("source_run", None), body.pop("ablate", None)
            body.pop("metric", None)
        if fault == "answer_token":
            body.pop("answer_token_id", None)
        if fault == "answer_token_id":
            body.pop("answer_token", None)
        if fault == "hooks":
            body.pop("hook", None)
    elif fault == "sources":
        body.pop("clean_prompt", None), body.pop("source_run", None), body.pop("ablate", None)
        body.pop("metric", None)
        if draw(st.booleans()):
            body.update(clean_prompt=PROMPT, ablate=True)
    elif fault == "both_hooks":
        body.update(hooks=["post_block"], hook="pre_attn")
    elif fault == "both_answers":
        body.update(answer_token=" Paris", answer_token_id=7042)
    elif fault == "no_answer":
        body.pop("answer_token", None), body.pop("answer_token_id", None)
    elif fault == "unknown_run":
        body.pop("clean_prompt", None), body.pop("ablate", None)
        body.pop("metric", None)
        body["source_run"] = "nosuch-run"
    elif fault == "extra":
        body["foo"] = 1
    else:  # cells: 3 hooks x 30 layers x 60 positions, over --max-sweep-cells
        body.update(layers="all", hooks=list(HOOKS), positions="all_prompt", prompt="word " * 60, ablate=True)
        body.pop("hook", None), body.pop("clean_prompt", None), body.pop("source_run", None)
        body.pop("metric", None)


# -- raw bodies ----------------------------------------------------------------------------------------------
POST_PATHS = [*GENERATION_PATHS, "/v1/steering/set", "/v1/steering/clear", "/v1/steering/vectors/register",
              "/v1/steering/vectors/unregister", "/v1/steering/vectors/contrastive", "/v1/patch_sweep"]


def _nested(depth: int, kind: str) -> bytes:
    return b"[" * depth + b"]" * depth if kind == "list" else b'{"a":' * depth + b"1" + b"}" * depth


@st.composite
def raw_cases(draw) -> Case:
    """Bodies that are not what a JSON API expects: not JSON, not an object, nested past any parser's depth
    (alone or inside one of our fields), JSON under a wrong content type, huge, or in another encoding."""
    path = draw(st.sampled_from(POST_PATHS))
    kind = draw(st.sampled_from(["junk", "junk", "nested", "nested_field", "content_type", "big", "encoding"]))
    content_type: str | None = "application/json"
    if kind == "junk":
        raw = draw(st.sampled_from([b"", b"{", b"not json", b"\xff\xfe\x00", b"[]", b"null", b'"x"', b"123",
                                    b"[1]", b"true", b'{"prompt": "x",}', b"NaN", b"{}" * 2]))
    elif kind == "nested":
        raw = _nested(draw(st.sampled_from([100, 999, 5000, 100_000])), draw(st.sampled_from(["list", "dict"])))
    elif kind == "nested_field":
        name = draw(st.sampled_from(ENDPOINT_FIELDS.get(path, ("vectors",))))
        depth = draw(st.sampled_from([100, 2000, 50_000]))
        raw = (b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "'
               + name.encode() + b'": ' + _nested(depth, draw(st.sampled_from(["list", "dict"]))) + b"}")
    elif kind == "content_type":
        content_type = draw(st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded",
                                             "multipart/form-data", "application/json; charset=latin-1"]))
        body = {"prompt": PROMPT, "max_tokens": 1, "capture": {"inline": {}}} if path in GENERATION_PATHS else {}
        if path == "/v1/steering/vectors/register":
            body = {"name": draw(st.sampled_from(NAMES)), "decode_vectors": {"post_block": {"2": _values(8, 8.0)}}}
        raw = json.dumps(body).encode()
    elif kind == "big":  # a megabyte of whitespace around an empty object
        raw = b" " * (1 << 20) + b"{}"
    else:
        raw = json.dumps({"prompt": PROMPT, "max_tokens": 1, "steering_name": PRELOADED_NAME}).encode("utf-16")
    return Case(f"POST {path}", path, "raw", raw=raw, content_type=content_type, auth=draw(AUTH))


def families(consumers: tuple[str, ...], disabled: tuple[str, ...] = ()) -> dict[str, st.SearchStrategy[Case]]:
    """The strategies by family (each run with its own number of examples: hypothesis's ``one_of`` would
    under-draw the larger generation bodies). ``consumers``: the server's enabled capture consumers;
    ``disabled``: built-ins it does not enable (naming one must be refused)."""
    return {
        "generation": generation_cases(consumers, disabled),
        "steering_routes": st.one_of(steering_set_cases(), steering_clear_cases(), register_cases(),
                                     unregister_cases(), contrastive_cases()),
        "patch_routes": st.one_of(patch_source_cases(), sweep_cases()),
        "raw_bodies": raw_cases(),
    }


# -- reproducers ------------------------------------------------------------------------------------------------
def _completion_body(**fields: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, **fields}


HUGE_INT = 10**400  # a JSON integer past float range: valid JSON, no float32 value
# The smallest bodies of the bugs fuzzing found (name -> case), checked by the same property.
REPRODUCERS: dict[str, Case] = {
    "overflowing-integer-in-a-vector": Case(
        "POST /v1/completions", COMPLETIONS, "broken", broken="steering_vectors",
        body=_completion_body(steering_vectors={"post_block": {"3": [HUGE_INT] + [0.0] * (HIDDEN - 1)}})),
    "overflowing-integer-scale": Case(
        "POST /v1/completions", COMPLETIONS, "broken", broken="steering_vectors",
        body=_completion_body(steering_vectors={"post_block": {"3": {"vector": [0.0] * HIDDEN, "scale": HUGE_INT}}})),
    "overflowing-integer-in-a-patch-vector": Case(
        "POST /v1/completions", COMPLETIONS, "broken", broken="patch",
        body=_completion_body(patch=[{"layer": 1, "hook": "post_block", "position": 0,
                                      "source": {"vector": [HUGE_INT] * HIDDEN}}])),
    "packed-form-with-a-layer-twice": Case(
        "POST /v1/completions", COMPLETIONS, "broken", broken="steering_vectors",
        body=_completion_body(steering_vectors={"post_block": {
            **pack_vectors({3: [1.0] * HIDDEN, 4: [2.0] * HIDDEN}), "layers": [3, 3]}})),
    "boolean-in-a-vector": Case(
        "POST /v1/completions", COMPLETIONS, "broken", broken="steering_vectors",
        body=_completion_body(steering_vectors={"post_block": {"3": [True] + [0.0] * (HIDDEN - 1)}})),
    "string-in-a-vector": Case(
        "POST /v1/completions", COMPLETIONS, "broken", broken="steering_vectors",
        body=_completion_body(steering_vectors={"post_block": {"3": ["1.0"] + [0.0] * (HIDDEN - 1)}})),
    "batch-chat-takes-a-broken-steering-field": Case(
        f"POST {CHAT_BATCH}", CHAT_BATCH, "broken", broken="steering_vectors",
        body={"messages": [CHAT], "max_tokens": 1, "steering_vectors": {"post_block": {"3": [1.0]}}}),
    "batch-chat-ignores-capture": Case(
        f"POST {CHAT_BATCH}", CHAT_BATCH, "broken", broken="capture",
        body={"messages": [CHAT], "max_tokens": 1, "capture": {"inline": {}}}),
    "batch-chat-passes-a-reserved-payload-to-the-engine": Case(
        f"POST {CHAT_BATCH}", CHAT_BATCH, "broken", broken="vllm_xargs",
        body={"messages": [CHAT], "max_tokens": 1, "vllm_xargs": {"vllm_interp": "x"}}),
    "json-body-that-is-not-an-object": Case("POST /v1/completions", COMPLETIONS, "raw", raw=b"123"),
    "json-body-that-is-not-an-object-on-batch-chat": Case(f"POST {CHAT_BATCH}", CHAT_BATCH, "raw", raw=b"123"),
    "streamed-sweep-of-a-prompt-past-the-context": Case(
        "POST /v1/patch_sweep", "/v1/patch_sweep", "edge", broken="prompt",
        body={"prompt": "word " * 600, "ablate": True, "layers": [0], "positions": [0], "answer_token": " Paris",
              "stream": True}),
    "sweep-of-a-prompt-past-the-context": Case(
        "POST /v1/patch_sweep", "/v1/patch_sweep", "edge", broken="prompt",
        body={"prompt": "word " * 600, "ablate": True, "layers": [0], "positions": [0], "answer_token": " Paris"}),
    "contrastive-prompt-past-the-context": Case(
        "POST /v1/steering/vectors/contrastive", "/v1/steering/vectors/contrastive", "edge", broken="positive",
        body={"positive": ["word " * 600], "negative": ["I hate this"], "layers": [0]}),
    "sweep-with-an-empty-clean-prompt": Case(
        "POST /v1/patch_sweep", "/v1/patch_sweep", "broken", broken="clean_prompt",
        body={"prompt": CORRUPT, "clean_prompt": "", "layers": [0], "answer_token": " Paris"}),
    "sweep-with-no-hooks": Case(
        "POST /v1/patch_sweep", "/v1/patch_sweep", "broken", broken="hooks",
        body={"prompt": CORRUPT, "ablate": True, "hooks": [], "layers": [0], "positions": [3],
              "answer_token": " Paris"}),
}


# -- sending and checking -------------------------------------------------------------------------------------
@dataclass
class Outcome:
    status: int | None
    body: bytes = b""
    json: Any = None
    events: list[tuple[str, str]] | None = None  # (event, data) of a server-sent event stream
    seconds: float = 0.0
    error: str | None = None  # no answer: timeout or connection failure

    def describe(self, limit: int = 600) -> str:
        if self.error:
            return f"no answer after {self.seconds:.1f} s: {self.error}"
        text = self.body.decode("utf-8", "replace")
        return f"{self.status} {text[:limit]}" + (f"... ({len(text)} chars)" if len(text) > limit else "")


def parse_events(text: str) -> list[tuple[str, str]]:
    """(event name, data) of each server-sent event (vLLM's ``data:`` lines and sse-starlette's named ones)."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            events.append((name, "\n".join(data)))
    return events


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _names(param: Any, field_name: str) -> bool:
    return isinstance(param, str) and (param == field_name or param.startswith(field_name + "."))


def _completion(answer: dict[str, Any]) -> tuple[list[str], list[float]]:
    """Texts and first choice's token logprobs of a (chat) completion."""
    choices = answer.get("choices") or []
    texts = [c.get("text") if "text" in c else (c.get("message") or {}).get("content") for c in choices]
    logprobs = (choices[0].get("logprobs") or {}) if choices else {}
    values = logprobs.get("token_logprobs") or [t.get("logprob") for t in logprobs.get("content") or []]
    return texts, values


def same_output(a: tuple[list[str], list[float]], b: tuple[list[str], list[float]], tolerance: float) -> bool:
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    return all(x == y or abs(x - y) <= tolerance for x, y in zip(a[1], b[1], strict=True))


@dataclass
class Failure:
    category: str
    endpoint: str
    mode: str
    detail: str
    request: str
    response: str

    def __str__(self) -> str:
        return (f"[{self.category}] {self.endpoint} ({self.mode}): {self.detail}\n  request:  {self.request}\n"
                f"  response: {self.response}")


class ServerDied(Exception):
    """The server stopped answering /health after a case: nothing after it can be checked."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"the server died after this case:\n{failure}")
        self.failure = failure


def summarize(failures: list[Failure], limit: int = 25) -> str:
    """Each distinct failure once (with how often it came), most frequent first."""
    groups: dict[tuple[str, str, str], list[Failure]] = {}
    for failure in failures:
        groups.setdefault((failure.category, failure.endpoint, failure.detail[:60]), []).append(failure)
    ranked = sorted(groups.values(), key=len, reverse=True)
    lines = [f"{len(failures)} failures, {len(ranked)} distinct:"]
    lines += [f"({len(found)}x) {found[0]}" for found in ranked[:limit]]
    if len(ranked) > limit:
        lines.append(f"... and {len(ranked) - limit} more distinct failures")
    return "\n".join(lines)


@dataclass
class Tally:
    """Counts per status, endpoint and mode, and every failure."""

    statuses: Counter = field(default_factory=Counter)
    endpoints: Counter = field(default_factory=Counter)
    endpoint_statuses: Counter = field(default_factory=Counter)  # (endpoint, status)
    modes: Counter = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    cases: int = 0


class Fuzzer:
    """Sends cases to one server and checks the property on each answer."""

    def __init__(self, url: str, timeout_s: float = GENERATION_TIMEOUT_S) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.session = requests.Session()
        self.tally = Tally()
        self._baselines: dict[str, tuple[list[str], list[float]]] = {}

    # -- state the checks read ---------------------------------------------------------------------------------
    def get(self, path: str) -> Any:
        return self.session.get(self.url + path, timeout=60).json()

    def keyed_post(self, path: str, body: Any = None) -> requests.Response:
        return self.session.post(self.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=self.timeout_s)

    def prepare(self) -> None:
        """Store the source run every patch and sweep case may name."""
        reply = self.session.post(self.url + COMPLETIONS, json={
            "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
            "capture": {"patch_source": {"hooks": "all", "positions": "all_prompt", "tag": CLEAN_RUN}}},
            timeout=self.timeout_s)
        reply.raise_for_status()
        assert reply.json()["capture_results"]["patch_source"]["status"] == "ok", reply.text

    def snapshot(self) -> tuple[set[str], set[str]]:
        """Named vectors and source runs now (``restore`` removes what fuzzing added)."""
        runs = {run["run_id"] for run in self.get("/v1/patch_sources")["runs"]}
        return set(self.get("/v1/steering/vectors")["names"]), runs

    def restore(self, snapshot: tuple[set[str], set[str]]) -> None:
        names, runs = snapshot
        for name in set(self.get("/v1/steering/vectors")["names"]) - names:
            self.keyed_post("/v1/steering/vectors/unregister", {"name": name})
        for run in {r["run_id"] for r in self.get("/v1/patch_sources")["runs"]} - runs:
            self.session.delete(f"{self.url}/v1/patch_sources/{quote(run, safe='')}",
                                headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        self.keyed_post("/v1/steering/clear")

    # -- one case --------------------------------------------------------------------------------------------
    def send(self, case: Case) -> Outcome:
        start = time.monotonic()
        try:
            with self.session.request(case.method, self.url + case.path, data=case.data(), headers=case.headers(),
                                      timeout=(10, self.timeout_s), stream=True, allow_redirects=False) as reply:
                content = b"".join(reply.iter_content(1 << 16))
                kind = reply.headers.get("content-type", "")
        except requests.RequestException as exc:
            self.session.close()  # whatever the connection's state, the next case starts on a new one
            return Outcome(None, seconds=time.monotonic() - start, error=f"{type(exc).__name__}: {exc}"[:300])
        text = content.decode("utf-8", "replace")
        events = parse_events(text) if kind.startswith("text/event-stream") else None
        return Outcome(reply.status_code, content, None if events is not None else _json(text), events,
                       time.monotonic() - start)

    def connection_kept(self) -> bool:
        """Whether the kept-alive connection survived the last answer: uvicorn closes it when an exception
        escaped the app, even one raised after the answer went out (the client then sees a fine answer)."""
        try:
            self.session.get(self.url + "/health", timeout=30)
        except requests.ConnectionError:
            self.session.close()
            return False
        return True

    def alive(self) -> bool:
        """/health on a new connection (the kept-alive one may have been dropped after an error), a few tries."""
        for _ in range(3):
            try:
                if requests.get(self.url + "/health", timeout=30).ok:
                    return True
            except requests.RequestException:
                pass
            time.sleep(2)
        return False

    def run(self, case: Case) -> list[Failure]:
        """Send ``case``, check the property, record the answer; the failures found. Raises ``ServerDied``
        when the server stopped answering after it."""
        outcome = self.send(case)
        if (outcome.status or 0) >= 500:
            self.session.close()  # the server closes its end after a 5xx
        # Probed before the checks, which read state over the same connection.
        dropped = outcome.status is not None and outcome.status < 500 and not self.connection_kept()
        problems = self.check(case, outcome)
        if dropped:
            problems.append(("exception after answering", "the server closed the connection after this answer "
                             "(an exception escaped the app)"))
        tally = self.tally
        tally.cases += 1
        tally.statuses[outcome.status or "no answer"] += 1
        tally.endpoints[case.endpoint] += 1
        tally.endpoint_statuses[case.endpoint, outcome.status or "no answer"] += 1
        tally.modes[case.mode] += 1
        failures = [Failure(category, case.endpoint, case.mode, detail, case.describe(), outcome.describe())
                    for category, detail in problems]
        tally.failures += failures
        if (outcome.error is not None or (outcome.status or 0) >= 500) and not self.alive():
            raise ServerDied(Failure("server died", case.endpoint, case.mode, "no /health after this case",
                                     case.describe(), outcome.describe()))
        return failures

    # -- the property ---------------------------------------------------------------------------------------------
    def check(self, case: Case, out: Outcome) -> list[tuple[str, str]]:
        if out.error is not None:
            return [("no answer", out.error)]
        assert out.status is not None
        if out.status >= 500:
            return [("5xx", f"status {out.status}")]
        if case.needs_key and not case.keyed:
            if out.status == 401:
                return []
            return [("accepted without a key" if out.status < 300 else "expected 401", f"status {out.status}")]
        if out.status >= 400:
            return self._refusal_problems(case, out)
        if out.status >= 300:
            return [("redirect", f"status {out.status}")]
        return self._acceptance_problems(case, out)

    def _refusal_problems(self, case: Case, out: Outcome) -> list[tuple[str, str]]:
        error = out.json.get("error") if isinstance(out.json, dict) else None
        if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error["message"]:
            if not (isinstance(out.json, dict) and out.json.get("detail")):
                return [("4xx without a JSON error", f"status {out.status}")]
            if case.method == "DELETE" and out.status == 404:
                return []  # the router's: no route takes that path (a run id with a newline, say); no run has it
            error = {"message": str(out.json["detail"])}  # FastAPI's own shape (routing, body parsing)
        param, message = error.get("param"), error["message"]
        problems = []
        tolerated = case.tolerate.get(out.status)
        if case.mode == "valid" and tolerated is None:
            problems.append(("valid request refused", f"{out.status} param={param!r}: {message[:300]}"))
        expected = (tolerated,) if tolerated is not None else (case.broken, *case.also) if case.broken else ()
        if expected and not any(_names(param, name) for name in expected):
            problems.append(("error does not name the field",
                             f"expected param {' or '.join(expected)!r}, got {param!r}: {message[:300]}"))
        path = case.path.split("?")[0]
        fields = ENDPOINT_FIELDS.get(path, ())
        top = param.split(".")[0] if isinstance(param, str) else None
        # Ours: a field of ours, or on our own routes the body or the run id (vLLM's errors name "body...").
        if top in fields or (path not in GENERATION_PATHS and param in ("body", "run_id")):
            if not message.startswith(param):
                problems.append(("message does not start with its param", f"param={param!r}: {message[:300]}"))
            body = case.parsed_body()
            if case.mode == "random" and isinstance(body, dict) and top in fields and top not in body \
                    and top in GENERATION_FIELDS:
                problems.append(("error names a field not in the body", f"param={param!r}: {message[:300]}"))
        return problems

    def _acceptance_problems(self, case: Case, out: Outcome) -> list[tuple[str, str]]:
        if case.mode == "broken":
            return [("broken field accepted", f"{case.broken!r} accepted with {out.status}")]
        problems: list[tuple[str, str]] = []
        final = out.json
        if out.events is not None:
            errors = [data for name, data in out.events if name == "error" or '"error"' in data[:20]]
            if errors:
                problems.append(("error event in a 200 stream", errors[0][:300]))
            datas = [data for _, data in out.events]
            if case.path in GENERATION_PATHS:
                if not datas or datas[-1] != "[DONE]":
                    problems.append(("stream without [DONE]", f"{len(datas)} events"))
                final = _json(datas[-2]) if len(datas) >= 2 else None
        body = case.parsed_body()
        if case.path in GENERATION_PATHS and isinstance(body, dict):
            capture = body.get("capture")
            if isinstance(capture, dict) and capture:
                results = final.get("capture_results") if isinstance(final, dict) else None
                missing = sorted(set(capture) - set(results or {}))
                if missing:
                    problems.append(("capture ignored", f"no capture_results for {missing}"))
        if case.effect is not None and not problems:
            try:
                problems += self._effect_problems(case, out, final)
            except requests.RequestException as exc:
                problems.append(("effect not checkable", f"{type(exc).__name__}: {exc}"[:300]))
        return problems

    def _effect_problems(self, case: Case, out: Outcome, final: Any) -> list[tuple[str, str]]:
        effect = case.effect
        assert effect is not None
        if effect.kind == "steering":
            steered, plain = _completion(final), self._baseline(case)
            if same_output(steered, plain, 1e-7):
                return [("steering ignored", f"output equals the unsteered one: {steered}")]
        elif effect.kind == "global_set":
            state = self.get("/v1/steering")
            for name, sites in effect.detail.items():
                held = {(int(layer), hook) for hook, layers in state[name].items() for layer in layers}
                if not sites <= held:
                    return [("global set ignored", f"{name}: {sorted(sites - held)} not in GET /v1/steering")]
        elif effect.kind == "cleared":
            if any(self.get("/v1/steering").values()):
                return [("clear ignored", "GET /v1/steering still holds vectors")]
        elif effect.kind in ("registered", "unregistered"):
            names = self.get("/v1/steering/vectors")["names"]
            if (effect.detail in names) != (effect.kind == "registered"):
                return [(f"{effect.kind[:-2]} ignored", f"names now: {names}")]
        elif effect.kind == "contrastive":
            return self._contrastive_problems(effect.detail, final)
        elif effect.kind == "deleted":
            if effect.detail in {r["run_id"] for r in self.get("/v1/patch_sources")["runs"]}:
                return [("delete ignored", f"{effect.detail} still listed")]
        elif effect.kind == "sources_listed":
            if not isinstance(final, dict) or not isinstance(final.get("runs"), list):
                return [("bad answer", "no runs list")]
        elif effect.kind == "sweep":
            return self._sweep_problems(effect.detail, out, final)
        return []

    def _baseline(self, case: Case) -> tuple[list[str], list[float]]:
        """The same request without our fields (cached; global steering is only ever zero vectors)."""
        body = {k: v for k, v in case.body.items() if k not in GENERATION_FIELDS}
        key = case.path + json.dumps(body, sort_keys=True)
        if key not in self._baselines:
            reply = self.session.post(self.url + case.path, json=body, timeout=self.timeout_s)
            reply.raise_for_status()
            self._baselines[key] = _completion(reply.json())
        return self._baselines[key]

    def _contrastive_problems(self, body: dict[str, Any], answer: Any) -> list[tuple[str, str]]:
        layers = list(range(NUM_LAYERS)) if body["layers"] == "all" else sorted(body["layers"])
        if not isinstance(answer, dict) or answer.get("layers") != layers:
            return [("contrastive answer wrong", f"layers {answer.get('layers') if isinstance(answer, dict) else None}"
                                                 f" for {layers}")]
        if answer["vectors"].get("shape") != [len(layers), HIDDEN] or sorted(map(int, answer["norms"])) != layers:
            return [("contrastive answer wrong", f"shape {answer['vectors'].get('shape')}")]
        if body.get("name") is not None and body["name"] not in self.get("/v1/steering/vectors")["names"]:
            return [("register ignored", f"contrastive vectors named {body['name']!r} not registered")]
        return []

    def _sweep_problems(self, detail: dict[str, Any], out: Outcome, final: Any) -> list[tuple[str, str]]:
        if detail["stream"]:
            kinds = [name for name, _ in out.events or []]
            if not kinds or kinds[0] != "start" or kinds[-1] != "summary":
                return [("sweep stream incomplete", f"events {kinds[:3]}...{kinds[-3:]}")]
            final = _json((out.events or [])[-1][1])
        grids = final.get("grids") if isinstance(final, dict) else None
        if not isinstance(grids, dict) or sorted(grids) != sorted(set(detail["hooks"])):
            return [("sweep answer wrong", f"grids for {sorted(grids or {})}, asked {detail['hooks']}")]
        rows = [len(grid["answer_logprob"]) for grid in grids.values()]
        if rows != [len(final["layers"])] * len(rows):
            return [("sweep answer wrong", f"{rows} rows for layers {final['layers']}")]
        return []


# -- the background stream -------------------------------------------------------------------------------------------
BACKGROUND_REQUESTS: dict[str, dict[str, Any]] = {
    "plain": {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1},
    "steered": {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1,
                "steering_vectors": {"post_block": {"6": vector(7)}}},
    "capturing": {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "logprobs": 1,
                  "capture": {"inline": {"hooks": {"post_block": [5]}, "positions": "last_prompt"}}},
}


@dataclass
class BackgroundResult:
    rounds: int = 0
    requests: int = 0
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    first: dict[str, Any] = field(default_factory=dict)
    max_drift: float = 0.0  # the largest logprob difference from a first answer with the same text

    @property
    def ok(self) -> bool:
        return self.rounds > 0 and not self.mismatches and not self.errors

    def __str__(self) -> str:
        return (f"{self.rounds} rounds, {self.requests} requests, {len(self.mismatches)} mismatches, "
                f"{len(self.errors)} errors, largest logprob drift {self.max_drift:.2e}"
                + "".join(f"\n  {m}" for m in (self.mismatches + self.errors)[:10]))


class BackgroundStream(threading.Thread):
    """Sends ``BACKGROUND_REQUESTS`` in turn until stopped; every answer must equal the first one of its kind
    (same texts, logprobs within ``ROUND_OFF``; the capturing one also a result with status ok)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True, name="fuzz-background")
        self.url = url
        self.result = BackgroundResult()
        self._stop_event = threading.Event()

    def run(self) -> None:
        session = requests.Session()
        while not self._stop_event.is_set():
            for name, body in BACKGROUND_REQUESTS.items():
                self._one(session, name, body)
            self.result.rounds += 1

    def _one(self, session: requests.Session, name: str, body: dict[str, Any]) -> None:
        result = self.result
        result.requests += 1
        try:
            reply = session.post(self.url + COMPLETIONS, json=body, timeout=GENERATION_TIMEOUT_S)
        except requests.RequestException as exc:
            result.errors.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
            return
        if reply.status_code != 200:
            result.errors.append(f"{name}: {reply.status_code} {reply.text[:300]}")
            return
        answer = reply.json()
        if "capture" in body:
            status = (answer.get("capture_results") or {}).get("inline", {}).get("status")
            if status != "ok":
                result.errors.append(f"{name}: capture status {status!r}")
        output = _completion(answer)
        first = result.first.setdefault(name, output)
        if output[0] == first[0] and len(output[1]) == len(first[1]):
            drift = max((abs(a - b) for a, b in zip(output[1], first[1], strict=True)), default=0.0)
            result.max_drift = max(result.max_drift, drift)
        if not same_output(output, first, ROUND_OFF):
            result.mismatches.append(f"{name} round {result.rounds}: {output} != first {first}")

    def stop(self) -> BackgroundResult:
        self._stop_event.set()
        self.join(timeout=GENERATION_TIMEOUT_S * 3)
        return self.result
