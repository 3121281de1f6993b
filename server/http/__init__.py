"""The HTTP layer around the routes: API keys, origin guard, CORS, the body limit, the request log, errors in
OpenAI's shape, the OpenAPI document and the web page at /."""
