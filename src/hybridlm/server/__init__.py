"""`hybridlm serve`: an OpenAI-compatible server of hybrid automata (docs/server.md).

    service = Service(model, model_id="smollm2-135m")   # the engine in its own thread
    app = create_app(service)                           # FastAPI: /v1/chat/completions, ...
    serve(service, port=8000)                           # or `with running(service) as url:`

Layers, each importing only the ones below: `wire` (the OpenAI request and error shapes),
`chat` (a chat request's conversation and the client's side of its jump map; the system
itself is hybridlm.turns'), `service` (the
engine's thread, continuations, arcs), `handlers` (requests → sequences → responses and
streams), `metrics`, `app` (the routes), `run` (uvicorn).
"""

from hybridlm.server.app import create_app
from hybridlm.server.run import running, serve
from hybridlm.server.service import Service

__all__ = ["Service", "create_app", "running", "serve"]
