"""The router's HTTP API, one folder per family, over one shared core.

Each family — ``chat``, ``completions``, ``messages`` (Anthropic's),
``responses`` (OpenAI's), ``tokenize``, ``models`` — keeps its request types
in ``protocol.py``, how it serves them in ``serving.py`` (Messages and
Responses translate onto chat in ``translate.py`` and then take chat's path),
and its routes, an ``APIRouter``, in ``api_router.py``. They share:

* ``protocol.py``: the engine protocol's integer limits, the sampling fields,
  OpenAI's usage object, the 400 that names a field;
* ``engine_request.py``: the one engine request every request becomes;
* ``streaming.py``: each family's response shape (`Shape`), and the
  `Responder` that answers with the whole response or its event stream;
* ``choices.py``: ``n`` choices (chat and completions);
* ``translation.py``: what the translations onto chat share;
* ``parts.py``: what the routes serve with, found on ``app.state``;
* ``operations.py``: ``/health`` and ``/metrics``.
"""
