"""The command line `python -m draft_opd_ray.serve` hands vLLM's own OpenAI server (`serve/server.py`), parsed and
checked by vLLM's parser and checks (vllm/entrypoints/launchers/cli_args.py: `make_arg_parser`,
`validate_parsed_serve_args`), and the launcher functions the server calls in vLLM's order
(vllm/entrypoints/launchers/api_server/entry.py `run_server_worker`, launcher.py, app.py)."""

from __future__ import annotations

import inspect
import re

K = 3


def test_the_server_command_line_is_one_vllms_own_parser_takes() -> None:
    from draft_opd_ray.config.schema import Config
    from draft_opd_ray.rollout.worker_ext import EXTENSION
    from draft_opd_ray.serve.server import vllm_args, vllm_argv

    target, draft = "/models/target", "/models/draft"
    cfg = Config()
    cfg.target.max_model_len = 512
    cfg.serve.port = 8123
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": K}
    args = vllm_args(vllm_argv(cfg, str(target), spec, capture_features=True))
    assert (args.model, args.port, args.host, args.max_model_len) == (str(target), 8123, "127.0.0.1", 512)
    assert args.speculative_config == spec and args.worker_extension_cls == EXTENSION
    assert args.enable_prefix_caching is False and args.enforce_eager  # CPU: eager; features: no prefix cache
    assert vllm_args(vllm_argv(cfg, str(target), spec, capture_features=False)).enable_prefix_caching is None


def test_the_server_is_built_as_vllms_run_server_worker_builds_it() -> None:
    """entry.py: `run_server_worker` builds the engine client from the args, then `build_and_serve` builds the app
    (`build_app(args, supported_tasks, model_config)`), fills its state (`init_app_state`) and hands it to
    `serve_http` with the socket `setup_server` made; `serve/server.run_server` makes the same calls."""
    from vllm.entrypoints.launchers.api_server import entry

    flat = re.sub(r"\s+", "", inspect.getsource(entry))
    for call in (
        "asyncwithbuild_async_engine_client(args,client_config=client_config,)asengine_client:",
        "app=build_app(args,supported_tasks,model_config)",
        "awaitinit_app_state(engine_client,app.state,args,supported_tasks)",
        "returnawaitserve_http(app,sock=sock,",
        "listen_address,sock=setup_server(args,reuse_port=False)",
    ):
        assert call in flat, call
    from draft_opd_ray.serve import server

    ours = re.sub(r"\s+", "", inspect.getsource(server.run_server))
    for call in (
        "asyncwithbuild_async_engine_client(args)asclient:",
        "app=build_app(args,tasks,client.model_config)",
        "awaitinit_app_state(client,app.state,args,tasks)",
        "_,sock=setup_server(args,reuse_port=False)",
    ):
        assert call in ours, call
