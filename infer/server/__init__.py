"""The OpenAI-compatible HTTP server: `python -m infer.server --model MODEL` or `infer serve [MODEL]`.

    args.py            flags (vLLM's names) and --config FILE.yaml -> ServerArgs + EngineConfig
    launch.py          uvicorn, the SIGTERM drain, the start-up log (effective config, KV capacity in tokens)
    app.py             the FastAPI app: /health, /metrics, /v1/models, OpenAI-shaped errors, the API key
    protocol.py        request models (pydantic) and APIError
    server_state.py    the engine of a served model and admission (503 / 429); which state serves a request
    request_params.py  a request body -> SamplingParams, its output constraint, priority, truncation
    fanout.py          the engine requests of one HTTP request, run together; streamed or collected
    engine_errors.py   the engine's refusals and failures as HTTP errors
    logprobs_json.py   logprobs in vLLM's and OpenAI's JSON shapes
    json_encoding.py   JSON bodies and server-sent events (orjson)
    completions.py     POST /v1/completions
    chat.py            POST /v1/chat/completions
    tokenization.py    POST /tokenize and /detokenize (vLLM's shapes)
    metrics.py         prometheus-client collectors with vLLM's metric names under `infer:`

The engine runs on its own thread (infer.engine.async_engine); the HTTP side only reads its counters.
"""
