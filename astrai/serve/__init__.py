"""Serving: the OpenAI-compatible HTTP server (`astrai serve`) and the terminal chat (`astrai chat`).

    server.py     `astrai serve`: engine, socket, uvicorn; clean stop on Ctrl-C / SIGTERM
      app.py        the Starlette routes (/v1/chat/completions, /v1/completions, /v1/models, /health,
                    /metrics), checks, SSE responses that cancel when the client leaves
      loop.py       EngineLoop: the one thread that steps the engine for every connection
      protocol.py   OpenAI request bodies, their checks, errors in OpenAI's shape
      responses.py  response bodies and stream chunks, logprobs
      metrics.py    Prometheus text exposition
    chat.py       `astrai chat`: a terminal chat loop on the engine

The HTTP stack (uvicorn + starlette) is the optional extra `astrai[serve]`; only server.py and
app.py import it, and `astrai serve` says how to install it when it is missing.

NOTE: astrai.serve uses astrai.infer (the engine) and astrai.config; nothing below imports it.
"""
