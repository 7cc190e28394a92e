"""Serving: the OpenAI-compatible HTTP server (`astrai serve`) and the terminal chat (`astrai chat`).

    server.py       `astrai serve`: engine, socket, uvicorn; clean stop on Ctrl-C / SIGTERM
      connections.py  uvicorn's h11 protocol with a header timeout and a connection cap; quiet repeated logs
      guard.py        ASGI middleware: Host allow-list, JSON-only bodies, body size and time bounds
      app.py          the Starlette routes (/v1/chat/completions, /v1/completions, /v1/models, /health,
                      /metrics), SSE responses that cancel when the client leaves
      checks.py       a request's checks before the engine: key, model, sizes, tokenizing, context, ids
      loop.py         EngineLoop: the one thread that steps the engine for every connection
      protocol.py     OpenAI request bodies, their checks, errors in OpenAI's shape
      responses.py    response bodies and stream chunks, logprobs (never NaN)
      metrics.py      Prometheus metrics (prometheus_client, the server's own registry)
    chat.py         `astrai chat`: a terminal chat loop on the engine

The HTTP stack (uvicorn, starlette, prometheus_client) is the optional extra `astrai[serve]`; only
server.py and the modules it loads import it, and `astrai serve` says how to install it when it is missing.

NOTE: astrai.serve uses astrai.infer (the engine) and astrai.config; nothing below imports it.
"""
