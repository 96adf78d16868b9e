"""The OpenAI-compatible HTTP server: `python -m infer.server --model MODEL` or `infer serve [MODEL]`.

    args.py          flags (the seeds' and vLLM's names) and --config FILE.yaml -> ServerArgs + EngineConfig
    launch.py        uvicorn, the SIGTERM drain, the start-up log (effective config, KV capacity in tokens)
    app.py           the FastAPI app: /health, /metrics, /v1/models, OpenAI-shaped errors, the API key
    protocol.py      request models (pydantic) and APIError
    serving.py       admission (503 / 429), the engine requests of one HTTP request, disconnects
    completions.py   POST /v1/completions
    chat.py          POST /v1/chat/completions
    tokenization.py  POST /tokenize and /detokenize (vLLM's shapes)
    metrics.py       prometheus-client collectors with vLLM's metric names under `infer:`

The engine runs on its own thread (infer.engine.async_engine); the HTTP side only reads its counters.
"""
