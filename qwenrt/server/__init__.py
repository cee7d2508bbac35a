"""`qwenrt serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra) over the engine.

app.py builds the application; chat.py and completions.py answer the two generation endpoints; protocol.py holds the
request models, responses.py the response bodies; bridge.py hands requests to the engine thread and its outputs back
to asyncio (qwenrt/stream_parser.py splits streamed text into reasoning, content and tool calls); metrics.py is /metrics;
errors.py puts every failure into OpenAI's error shape; main.py is the command.
"""
