"""The OpenAI-compatible HTTP server: `python -m infer.server --model MODEL` or `infer serve [MODEL]`.

    args.py              flags (vLLM's names) and --config FILE.yaml -> ServerArgs + EngineConfig
    launch.py            uvicorn, the SIGTERM drain, the start-up log (the effective config, KV capacity)
    tcmalloc.py          `infer serve` re-executed with tcmalloc preloaded, where it is installed
    app.py               the FastAPI app: /health, /metrics, /v1/models, OpenAI-shaped errors, the API key
    auth.py              API keys and the owner (a key's hash) of each request
    request_body.py      a body bounded in size, JSON in UTF-8, read to its end before the connection closes
    header_timeout.py    a bound on the time a client takes to send its headers
    protocol.py          request models (pydantic), APIError, the response shapes, the ids a client sees
    server_state.py      the engine of a served model and admission (503 / 429); which state serves a request
    model_specs.py       several models: the flags and the models they name
    model_manager.py     several models: which are loaded, loading on demand, unloading the idle ones
    request_params.py    a request body -> SamplingParams, its output constraint, priority, truncation
    fanout.py            the engine requests of one HTTP request, run together; streamed or collected
    engine_errors.py     the engine's refusals and failures as HTTP errors
    logprobs_json.py     logprobs in vLLM's and OpenAI's JSON shapes
    json_encoding.py     JSON bodies and server-sent events (orjson)
    completions.py       POST /v1/completions
    chat.py              POST /v1/chat/completions
    responses.py         POST /v1/responses, and GET / DELETE of a stored one (responses_input.py: the
                         input as chat messages; responses_items.py: the streamed output items)
    tools.py             tool calls without a model's own parser (forced by tool_choice); tool_call_parser.py
                         reads them out of the output as it streams
    tool_parsers/        the tool calls a model writes on its own, one parser per format
    reasoning.py         the thinking apart from the answer (--reasoning-parser)
    embeddings.py        POST /v1/embeddings (pooling_protocol.py: the request bodies of pooling models)
    scoring.py           POST /score and /rerank
    tokenization.py      POST /tokenize and /detokenize (vLLM's shapes)
    metrics.py           prometheus-client collectors with vLLM's metric names under `infer:`

The engine runs on its own thread (infer.engine.async_engine); the HTTP side only reads its counters.
"""
