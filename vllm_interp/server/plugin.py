"""The ``vllm.endpoint_plugins`` entry point: vllm-interp's HTTP surface on vLLM's OpenAI server.

Paired with the general plugin (``vllm_interp.engine.plugin``), which installs the worker-side RPC methods
these routes call. ``vllm-interp serve`` allowlists it in ``VLLM_PLUGINS`` (vLLM loads endpoint plugins
only when named there).
"""

from argparse import Namespace

from fastapi import FastAPI
from starlette.datastructures import State

from vllm_interp.config import FrontendLimits, InterpConfig
from vllm_interp.engine.versions import adapter
from vllm_interp.frontend import InterpFrontend, ResultsPoller
from vllm_interp.hooks import ModelShape
from vllm_interp.server import patch_routes, steering_routes
from vllm_interp.server.auth import configured_keys
from vllm_interp.server.request_fields import RequestFieldsMiddleware
from vllm_interp.server.shared_steering import SharedSteering
from vllm_interp.steering.files import load_named_file, parse_named_file

PLUGIN_NAME = "vllm_interp_http"


class InterpEndpoints:
    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        # The middleware's payloads reach the engine through vLLM's request objects: hooked before any request.
        adapter("openai_params").install()
        app.include_router(steering_routes.router)
        app.include_router(patch_routes.router)
        app.include_router(patch_routes.sweep_router)
        app.add_middleware(RequestFieldsMiddleware)

    async def init_state(self, engine_client, state: State, args: Namespace) -> None:
        vllm_config = engine_client.vllm_config
        config = InterpConfig.from_additional_config(vllm_config.additional_config) or InterpConfig()
        model_config = vllm_config.model_config
        shape = ModelShape(model_config.get_total_num_hidden_layers(), model_config.get_hidden_size())
        limits = FrontendLimits.from_args(args)
        frontend = InterpFrontend.for_engine(config, shape, limits)
        for flag in getattr(args, "steering_vectors", None) or []:
            name, path = parse_named_file(flag)
            frontend.steering.register(name, load_named_file(path))
        shared = SharedSteering.for_server(frontend.steering)
        shared.adopt_or_publish()
        frontend.sync_steering = shared.refresh
        state.vllm_interp_shared_steering = shared
        state.vllm_interp_frontend = frontend
        state.vllm_interp_results = ResultsPoller.for_engine(engine_client)
        state.vllm_interp_api_keys = configured_keys(getattr(args, "steering_api_key", None))
        state.vllm_interp_limits = limits
        state.vllm_interp_max_model_len = model_config.max_model_len
